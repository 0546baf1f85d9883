"""Timeline events of chosen steps, one JSON line each, for trace.json (Chrome trace format).

Every process of a job (workers, aggregator, updaters) appends complete events ("ph": "X",
wall-clock microseconds, so processes line up) to <run dir>/trace/<process>.jsonl for the
steps listed in run.trace_steps; the launcher merges them (launch/tracefile.py). Outside
those steps a span costs one set lookup.

Work queued on CUDA streams (a worker's compute and copies) is timed by a pair of CUDA events per
span (`device_span`): nothing waits for them, so a traced step overlaps its copies and compute as
an untraced one does. They are read once the step's work is done (`flush_device`, after the
worker's end-of-step synchronize) and placed on the wall clock by an anchor event recorded after
all of them.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


class Tracer:
    def __init__(self, run_dir: str | os.PathLike | None, process: str, steps: tuple[int, ...] | frozenset[int]) -> None:
        self.process = process
        self.steps = frozenset(steps) if run_dir else frozenset()
        self._file = None
        if self.steps:
            folder = Path(run_dir) / "trace"
            folder.mkdir(parents=True, exist_ok=True)
            self._file = open(folder / f"{process}.jsonl", "a", buffering=1)
        self._device: list[tuple[str, str, int, Any, Any, dict]] = []  # spans whose events are not read yet

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

    @contextmanager
    def device_span(self, name: str, track: str, step: int, stream: Any = None, **args) -> Iterator[None]:
        """A span of the work queued on a CUDA stream (the current one by default) while the block
        runs, as the device ran it: two CUDA events, read at `flush_device`; the host never waits."""
        if step not in self.steps:
            yield
            return
        import torch

        stream = stream or torch.cuda.current_stream()
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        try:
            yield
        finally:
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            self._device.append((name, track, step, start, end, args))

    def flush_device(self, device: Any = None, anchor: Any = None, now: float | None = None) -> None:
        """Write the device spans recorded so far. Waits for the device, then records an anchor event
        and takes the wall clock when it has run: an event `ms` before the anchor ran `ms` before
        that time. (anchor, now: given by tests.)"""
        if not self._device:
            return
        if anchor is None:
            import torch

            torch.cuda.synchronize(device)
            anchor = torch.cuda.Event(enable_timing=True)
            anchor.record(torch.cuda.current_stream(device))
            anchor.synchronize()
            now = time.time()
        assert now is not None
        pending, self._device = self._device, []
        for name, track, step, start, end, args in pending:
            self.event(name, track, step, now - start.elapsed_time(anchor) / 1e3, now - end.elapsed_time(anchor) / 1e3,
                       **args)

    def close(self) -> None:
        # spans still pending belong to a step that failed before its flush: reading them would wait on a
        # device that may be in error or stuck in a collective whose peer is gone, so they are dropped
        self._device.clear()
        if self._file is not None:
            self._file.close()
            self._file = None


NULL = Tracer(None, "", ())
