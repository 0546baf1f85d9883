"""The launcher's core: steps complete in order, once committed and reported by every rank."""

from __future__ import annotations

from slidedp.launch.steps import StepLedger
from slidedp.protocol import Ack, StepDone, WorkerStats


def done(step: int) -> StepDone:
    return StepDone(step, 2.0 + step, 1.0, 0, 0.1, 0.0)


def stats(rank: int, step: int) -> WorkerStats:
    return WorkerStats(rank, step, 1.0, 0.4, 0.6, 0.0, 0.0, 0.0, 100, 0, 0, 0.0)


def test_a_step_completes_once_committed_and_reported_by_every_rank():
    ledger = StepLedger(start=3, end=6, world=2, checkpoint_every=0)
    assert ledger.on_message(stats(0, 3)) is False
    assert ledger.on_message(done(3)) is True  # a commit is progress
    assert ledger.complete() is None  # rank 1 has not reported
    ledger.on_message(stats(1, 4))  # a later step's stats wait for their step
    ledger.on_message(stats(1, 3))
    got = ledger.complete()
    assert got is not None and (got.step, got.done, sorted(got.stats), got.checkpoint) == (3, done(3), [0, 1], False)
    assert ledger.committed == 4 and ledger.complete() is None


def test_steps_complete_in_order():
    ledger = StepLedger(start=0, end=4, world=1, checkpoint_every=0)
    for m in (done(1), stats(0, 1)):
        ledger.on_message(m)
    assert ledger.complete() is None  # step 0 first
    for m in (done(0), stats(0, 0)):
        ledger.on_message(m)
    assert [ledger.complete().step, ledger.complete().step] == [0, 1]
    assert ledger.complete() is None


def test_ranks_that_are_gone_do_not_hold_a_committed_step_back():
    ledger = StepLedger(start=0, end=2, world=3, checkpoint_every=0)
    ledger.on_message(stats(0, 0))
    assert ledger.complete(ranks_gone=True) is None  # not committed: nothing completes
    ledger.on_message(done(0))
    got = ledger.complete(ranks_gone=True)
    assert got is not None and list(got.stats) == [0]


def test_a_checkpoint_is_due_every_n_steps_but_not_after_the_last():
    ledger = StepLedger(start=0, end=4, world=1, checkpoint_every=2)
    due = []
    for step in range(4):
        ledger.on_message(done(step))
        ledger.on_message(stats(0, step))
        due.append(ledger.complete().checkpoint)
    assert due == [False, True, False, False]  # after step 1 (2 committed); after step 3 the job's end does it


def test_other_messages_are_ignored():
    ledger = StepLedger(start=0, end=1, world=1, checkpoint_every=0)
    assert ledger.on_message(Ack(1, "x")) is False and ledger.on_message(None) is False
    assert ledger.complete() is None
