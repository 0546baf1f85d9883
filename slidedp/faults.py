"""Fault points for the crash tests: a process holds at a named point of its work until told to go on.

SLIDEDP_HOLD_AT="<point>@<step>:<marker path>": the first time this process reaches `point` in step
`step` or later, it writes the marker (JSON: its pid and what it is doing) and waits while the marker
exists (at most 300 s), so a test can kill -9 it, or another process, at exactly that point, whatever
the machine's speed; or leave it held, a rank stuck in compute (the stall tests: "backward", before a
layer's backward, outside any collective). Unset (always, outside tests), a fault point costs one dictionary lookup.
"""

from __future__ import annotations

import json
import os
import time

ENV = "SLIDEDP_HOLD_AT"
_held: set[str] = set()


def hold(point: str, step: int, **what: object) -> None:
    spec = os.environ.get(ENV)
    if not spec or point in _held:
        return
    where, _, path = spec.partition(":")
    name, _, first = where.partition("@")
    if name != point or step < int(first or 0):
        return
    _held.add(point)
    tmp = f"{path}.{os.getpid()}.tmp"  # ranks that hold at one point each write their own, then one wins
    with open(tmp, "w") as f:
        json.dump({"pid": os.getpid(), "point": point, "step": step, **what}, f)
    os.rename(tmp, path)
    deadline = time.monotonic() + 300.0
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
