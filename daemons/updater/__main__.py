"""`python -m slidedp.daemons.updater --store NAME`: the pool."""

import sys

from slidedp.daemons.updater.shell import main

sys.exit(main())
