"""Between steps a worker takes the launcher's orders; at a checkpoint it waits for one (in-process)."""

from __future__ import annotations

import pytest

from slidedp.protocol import CONTROL_CONTINUE, CONTROL_STOP, Control
from slidedp.stopflag import StopFlag
from slidedp.transport import PeerTimeout
from slidedp.worker.core import await_launcher


class Launcher:
    """Stands in for LauncherLink: hands out the orders queued, then nothing."""

    def __init__(self, *orders: Control, stop_after: StopFlag | None = None) -> None:
        self.orders, self.polls, self.stop_after = list(orders), 0, stop_after

    def control(self, timeout_ms: int) -> Control | None:
        self.polls += 1
        if self.stop_after is not None and self.polls == 3:
            self.stop_after.set()  # SIGTERM arrives while the worker is held
        return self.orders.pop(0) if self.orders else None


def test_without_a_checkpoint_the_worker_goes_on_at_once():
    launcher = Launcher()
    assert await_launcher(launcher, 4, hold=False, hold_s=60, stop=StopFlag(), rank=0) is False
    assert launcher.polls == 1


def test_a_stop_order_is_taken_between_any_two_steps():
    assert await_launcher(Launcher(Control(CONTROL_STOP, 4)), 4, hold=False, hold_s=60, stop=StopFlag(), rank=0)


def test_at_a_checkpoint_the_worker_waits_for_the_order_of_its_step():
    launcher = Launcher(None, Control(CONTROL_CONTINUE, 3), Control(CONTROL_CONTINUE, 4))
    assert await_launcher(launcher, 4, hold=True, hold_s=60, stop=StopFlag(), rank=0) is False
    assert launcher.polls == 3 and launcher.orders == []  # an order for another step does not release it


def test_sigterm_while_held_stops_the_worker():
    stop = StopFlag()
    assert await_launcher(Launcher(stop_after=stop), 4, hold=True, hold_s=60, stop=stop, rank=0) is True


def test_a_launcher_that_never_answers_is_named():
    with pytest.raises(PeerTimeout, match="rank 2 waited for the launcher past the checkpoint after step 4"):
        await_launcher(Launcher(), 4, hold=True, hold_s=0.0, stop=StopFlag(), rank=2)
