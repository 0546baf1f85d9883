"""A rank's progress file (slidedp/rank_progress.py): what the worker stores is what its launcher reads, at
once (the mapping is shared, nothing is flushed), and a file that is absent or not whole reads as nothing."""

from __future__ import annotations

import stat

from slidedp.rank_progress import NO_PROGRESS, ProgressFile, RankProgress, progress_path, read_progress


def test_entered_left_and_step_read_as_stored(tmp_path):
    path = progress_path(tmp_path, 3)
    assert path.name == ".progress-rank3"
    assert read_progress(path) is None  # the worker has not made it yet
    f = ProgressFile(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_progress(path) == RankProgress(0, 0, 0)
    f.at_step(7)
    f.enter()
    got = read_progress(path)
    assert got == RankProgress(1, 0, 7) and got.inside  # waiting in collective 1
    f.leave()
    f.enter()
    f.leave()
    got = read_progress(path)
    assert got == RankProgress(2, 2, 7) and not got.inside
    f.close()
    assert read_progress(path) == RankProgress(2, 2, 7)  # the file outlives the worker
    ProgressFile(path).close()  # a new worker starts it again
    assert read_progress(path) == RankProgress(0, 0, 0)


def test_a_file_not_whole_or_of_something_else_reads_as_nothing(tmp_path):
    short = tmp_path / "short"
    short.write_bytes(b"\0" * 16)
    other = tmp_path / "other"
    other.write_bytes(b"\1" * 32)
    assert read_progress(short) is None and read_progress(other) is None


def test_one_host_counts_nothing():
    NO_PROGRESS.enter()
    NO_PROGRESS.leave()
    NO_PROGRESS.at_step(1)
    assert NO_PROGRESS.entered == 0
