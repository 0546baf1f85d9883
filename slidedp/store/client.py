"""Talk to a store: through its host-state daemon when one runs, else in this process.

Whether a daemon runs is read from its lock (`hoststate.lock` in the run dir): a held lock
is a live daemon, with no race against a half-started one.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Any, Iterator

import zmq

from .. import daemonlock
from ..protocol import Reply, request
from ..transport import request as zmq_request


class StoreRequestError(RuntimeError):
    pass


def daemon_running(store: str) -> bool:
    return daemonlock.held(store, "hoststate")


@contextmanager
def _in_process(store: str) -> Iterator[Any]:
    from slidedp.daemons.hoststate import HostStateCore

    fd = daemonlock.acquire(store, "hoststate")  # keeps a daemon from starting while we work on the segments
    core = HostStateCore(store)
    try:
        yield core
    finally:
        core.close()
        os.close(fd)


def call(store: str, kind: str, timeout_s: float = 600.0, **args: Any) -> dict[str, Any]:
    """One request to the store; raises StoreRequestError with the daemon's message on refusal."""
    if daemon_running(store):
        ctx = zmq.Context.instance()
        reply = zmq_request(ctx, store, request(kind, json.dumps(args)), timeout_s, (Reply,))
        if not reply.ok:
            raise StoreRequestError(reply.text)
        return json.loads(reply.text)
    from slidedp.daemons.hoststate import RequestError

    with _in_process(store) as core:
        try:
            return core.handle(kind, args)
        except RequestError as e:
            raise StoreRequestError(str(e)) from None
