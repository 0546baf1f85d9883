"""Talk to a store: through its host-state daemon when one runs, else in this process.

Whether a daemon runs is read from its lock (`hoststate.lock` in the run dir): a held lock
is a live daemon, with no race against a half-started one.
"""

from __future__ import annotations

import json
import os
from typing import Any

import zmq

from .. import daemonlock
from ..protocol import Reply, request
from ..transport import request as zmq_request
from .manifest import ManifestError
from .shm import PREFIX, SHM_DIR, unlink_store
from .store import StoreError


class StoreRequestError(RuntimeError):
    pass


def daemon_running(store: str) -> bool:
    return daemonlock.held(store, "hoststate")


def _serve_here(store: str, kind: str, args: dict[str, Any]) -> dict[str, Any]:
    from .service import REFUSALS, HostStateCore, refusal_text  # the daemon's logic; it imports torch

    fd = daemonlock.acquire(store, "hoststate")  # keeps a daemon from starting while we work on the segments
    try:
        try:
            core = HostStateCore(store)
        except (StoreError, ManifestError) as e:  # segments there but not attachable: corrupt or incomplete
            if kind == "destroy":  # its only way out, so it must not need an attach
                return {"removed": unlink_store(store), "unreadable": str(e)}
            raise StoreRequestError(f"{e} (`slidedp-store destroy {store}` removes it)") from None
        try:
            return core.handle(kind, args)
        except REFUSALS as e:  # as the daemon refuses it
            raise StoreRequestError(refusal_text(e)) from None
        finally:
            core.close()
    finally:
        os.close(fd)


def call(store: str, kind: str, timeout_s: float = 600.0, **args: Any) -> dict[str, Any]:
    """One request to the store; raises StoreRequestError with the daemon's message on refusal."""
    if daemon_running(store):
        ctx = zmq.Context.instance()
        reply = zmq_request(ctx, store, request(kind, json.dumps(args)), timeout_s, (Reply,))
        if not reply.ok:
            raise StoreRequestError(reply.text)
        return json.loads(reply.text)
    owner = _segment_owner(store)
    if owner is not None and owner != os.getuid():
        raise StoreRequestError(
            f"store {store!r} belongs to uid {owner} and none of its daemons is visible to this user: run the command "
            f"as that user (e.g. `sudo -u slidedp slidedp-store ...`), so that requests go through its daemon"
        )
    return _serve_here(store, kind, args)


def _segment_owner(store: str) -> int | None:
    """uid owning the store's manifest segment, or None if there is none."""
    try:
        return os.stat(os.path.join(SHM_DIR, f"{PREFIX}{store}.manifest")).st_uid
    except FileNotFoundError:
        return None
