"""Where a store's sockets and state live: one private (0700) run directory per store.

Resolution order: $SLIDEDP_RUN_ROOT/<store>, else systemd's $RUNTIME_DIRECTORY (the unit's
`RuntimeDirectory=slidedp/%i`), else $XDG_RUNTIME_DIR/slidedp/<store>, else
/tmp/slidedp-<uid>/<store>. The same function runs in daemons, launcher and workers,
so every process agrees without passing paths around.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

_STORE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_store_name(name: str) -> str:
    if not _STORE_NAME.match(name):
        raise ValueError(
            f"store name {name!r} is not allowed: use 1-64 letters, digits, '_', '-' or '.', starting with a letter or digit"
        )
    return name


def run_root() -> Path:
    if os.environ.get("SLIDEDP_RUN_ROOT"):
        return Path(os.environ["SLIDEDP_RUN_ROOT"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "slidedp"
    return Path(f"/tmp/slidedp-{os.getuid()}")


def run_dir(store: str, create: bool = True) -> Path:
    """The store's private run directory (0700), created if asked."""
    check_store_name(store)
    runtime = os.environ.get("RUNTIME_DIRECTORY")
    path = Path(runtime.split(":")[0]) if runtime and not os.environ.get("SLIDEDP_RUN_ROOT") else run_root() / store
    if create:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.stat()
        if st.st_uid != os.getuid():
            raise PermissionError(f"run directory {path} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(path, 0o700)
    return path


def socket_address(store: str, name: str) -> str:
    """ZeroMQ ipc:// address of one of the store's sockets (inside the 0700 run dir)."""
    return f"ipc://{run_dir(store) / name}.sock"
