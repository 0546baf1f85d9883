"""`python -m slidedp.daemons.updater --store NAME`: the pool."""

import sys

from slidedp.daemons.updater.pool import main

sys.exit(main())
