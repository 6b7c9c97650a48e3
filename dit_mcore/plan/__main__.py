import sys

from dit_mcore.plan.cli import main

sys.exit(main())
