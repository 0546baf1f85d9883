"""`python -m slidedp.daemons.aggregator --store NAME`."""

import sys

from slidedp.daemons.aggregator.core import main

sys.exit(main())
