"""`python -m slidedp.daemons.aggregator --store NAME`."""

import sys

from slidedp.daemons.aggregator.shell import main

sys.exit(main())
