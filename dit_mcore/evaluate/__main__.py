"""``python -m dit_mcore.evaluate``: see :mod:`dit_mcore.evaluate.cli`."""
import sys

from dit_mcore.evaluate.cli import main

sys.exit(main())
