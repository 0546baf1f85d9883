"""The launcher's core: which steps are complete, and what each completion asks of the launcher.

A step is complete when the aggregator has committed it (`StepDone`) and every rank has sent its
stats (`WorkerStats`), or the ranks are gone (the stats of a rank that exited never come). A rank
that ran the eval after the step sends its share (`EvalLoss`) before its stats. Steps
complete in order. After a completed step the launcher may owe a checkpoint (every
`checkpoint.every` steps, except after the last, which the end of the job checkpoints).
JobRun (jobrun.py) feeds it from its sockets; tests drive it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slidedp.protocol import EvalLoss, Message, StepDone, WorkerStats


@dataclass
class _Step:
    done: StepDone | None = None
    stats: dict[int, WorkerStats] = field(default_factory=dict)
    evals: dict[int, EvalLoss] = field(default_factory=dict)

    def eval_loss(self) -> float | None:
        """The eval loss over every rank's share (None when no eval ran after this step)."""
        if not self.evals:
            return None
        count = sum(e.tokens for e in self.evals.values())
        return sum(e.loss_sum for e in self.evals.values()) / max(count, 1)


@dataclass(frozen=True)
class Completed:
    step: int
    done: StepDone
    stats: dict[int, WorkerStats]
    checkpoint: bool  # a checkpoint is due after this step (training goes on while it is written)
    eval_loss: float | None = None  # the eval loss on the weights after this step, where one ran


class StepLedger:
    def __init__(self, start: int, end: int, world: int, checkpoint_every: int) -> None:
        self.committed, self.end, self.world, self.every = start, end, world, checkpoint_every
        self.steps: dict[int, _Step] = {}

    def on_message(self, msg: Message | None) -> bool:
        """Take a StepDone or WorkerStats (anything else is ignored); True for a StepDone (progress)."""
        if isinstance(msg, StepDone):
            self.steps.setdefault(msg.step, _Step()).done = msg
            return True
        if isinstance(msg, WorkerStats):
            self.steps.setdefault(msg.step, _Step()).stats[msg.rank] = msg
        elif isinstance(msg, EvalLoss):
            self.steps.setdefault(msg.step, _Step()).evals[msg.rank] = msg
        return False

    def complete(self, ranks_gone: bool = False) -> Completed | None:
        """The next step in order if it is complete (and count it committed), else None."""
        st = self.steps.get(self.committed)
        if st is None or st.done is None or (len(st.stats) < self.world and not ranks_gone):
            return None
        del self.steps[self.committed]
        step = self.committed
        self.committed += 1
        due = bool(self.every) and self.committed % self.every == 0 and self.committed < self.end
        return Completed(step, st.done, st.stats, due, st.eval_loss())
