"""``python -m dit_mcore.evaluate``: see :mod:`dit_mcore.evaluate.cli`."""
import sys

from dit_mcore.startup import imports_uncollected

with imports_uncollected():
    from dit_mcore.evaluate.cli import main

sys.exit(main())
