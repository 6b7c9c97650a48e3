import sys

from dit_mcore.startup import imports_uncollected

with imports_uncollected():
    from dit_mcore.plan.cli import main

sys.exit(main())
