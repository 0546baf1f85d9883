"""Timeline events of chosen steps, one JSON line each, for trace.json (Chrome trace format).

Every process of a job (workers, aggregator, updaters) appends complete events ("ph": "X",
wall-clock microseconds, so processes line up) to <run dir>/trace/<process>.jsonl for the
steps listed in run.trace_steps; the launcher merges them (launch/tracefile.py). Outside
those steps a span costs one set lookup.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


class Tracer:
    def __init__(self, run_dir: str | os.PathLike | None, process: str, steps: tuple[int, ...] | frozenset[int]) -> None:
        self.process = process
        self.steps = frozenset(steps) if run_dir else frozenset()
        self._file = None
        if self.steps:
            folder = Path(run_dir) / "trace"
            folder.mkdir(parents=True, exist_ok=True)
            self._file = open(folder / f"{process}.jsonl", "a", buffering=1)

    def on(self, step: int) -> bool:
        return step in self.steps

    def event(self, name: str, track: str, step: int, start_s: float, end_s: float, **args) -> None:
        """Record [start_s, end_s] (time.time() seconds) on `track` if `step` is traced."""
        if self._file is None or step not in self.steps:
            return
        self._file.write(json.dumps({
            "name": name, "ph": "X", "ts": start_s * 1e6, "dur": max(0.0, end_s - start_s) * 1e6,
            "pid": self.process, "tid": track, "args": dict(args, step=step),
        }) + "\n")

    @contextmanager
    def span(self, name: str, track: str, step: int, **args) -> Iterator[None]:
        if step not in self.steps:
            yield
            return
        t0 = time.time()
        try:
            yield
        finally:
            self.event(name, track, step, t0, time.time(), **args)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


NULL = Tracer(None, "", ())
