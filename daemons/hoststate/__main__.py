"""`python -m slidedp.daemons.hoststate --store NAME`."""

import sys

from slidedp.daemons.hoststate.shell import main

sys.exit(main())
