"""`python -m slidedp.worker`: one rank, as the launcher spawns it."""

import sys

from slidedp.worker.shell import main

sys.exit(main())
