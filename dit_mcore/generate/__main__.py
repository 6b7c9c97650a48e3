"""``python -m dit_mcore.generate``: see :mod:`dit_mcore.generate.cli`."""
import sys

from dit_mcore.startup import imports_uncollected

with imports_uncollected():
    from dit_mcore.generate.cli import main

sys.exit(main())
