"""`python -m slidedp.worker`: one rank, as the launcher spawns it."""

from slidedp.lifetime import end_process
from slidedp.worker.shell import main

end_process(main())  # not sys.exit: torch's teardown at exit can abort a rank whose steps all committed
