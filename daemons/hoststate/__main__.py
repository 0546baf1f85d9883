"""`python -m slidedp.daemons.hoststate --store NAME`."""

import sys

from slidedp.store.service import main

sys.exit(main())
