"""Where a store's sockets and locks live: one private (0700) run directory per store.

Every process of a store (daemons, launcher, workers, `slidedp-store`) calls `run_dir()`
and must get the same answer without being told, so the choice is a fixed order of
rules, the first that applies wins:

1. `$SLIDEDP_RUN_ROOT/<store>`: an explicit choice (the test suite, unusual setups);
2. `$RUNTIME_DIRECTORY`, the entry named `<store>`: inside a systemd unit with
   `RuntimeDirectory=slidedp/%i` (systemd sets it; entries are ':'-separated);
3. `/run/slidedp/<store>` when it exists, is a real directory and belongs to this user:
   a launcher or `slidedp-store` started by hand as the units' user finds the daemons
   that systemd runs (rule 2 gave them the same directory);
4. `$XDG_RUNTIME_DIR/slidedp/<store>` (also where a `systemd --user` unit's rule 2 points);
5. `/tmp/slidedp-<uid>/<store>`.

Rule 3 never creates /run/slidedp (only systemd does, as root) and never follows a
directory of another user: that one is not ours to use, and the next rules apply.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

_STORE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
SYSTEM_RUN_ROOT = Path("/run/slidedp")  # RuntimeDirectory=slidedp/%i of the units in systemd/


def check_store_name(name: str) -> str:
    if not _STORE_NAME.match(name):
        raise ValueError(
            f"store name {name!r} is not allowed: use 1-64 letters, digits, '_', '-' or '.', starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class RunDir:
    path: Path
    rule: str  # which rule chose it: "SLIDEDP_RUN_ROOT", "RUNTIME_DIRECTORY", "system", "XDG_RUNTIME_DIR", "tmp"


def _owned_dir(path: Path, uid: int) -> bool:
    try:
        st = os.lstat(path)  # lstat: a symlink planted there is not our directory
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid


def resolve_run_dir(store: str, environ: Mapping[str, str] | None = None, system_root: Path = SYSTEM_RUN_ROOT,
                    uid: int | None = None) -> RunDir:
    """The run directory of `store` by the rules above; touches nothing but one lstat.

    `environ`, `system_root` and `uid` default to this process's; tests pass their own.
    """
    check_store_name(store)
    env = os.environ if environ is None else environ
    uid = os.geteuid() if uid is None else uid
    if env.get("SLIDEDP_RUN_ROOT"):
        return RunDir(Path(env["SLIDEDP_RUN_ROOT"]) / store, "SLIDEDP_RUN_ROOT")
    for entry in env.get("RUNTIME_DIRECTORY", "").split(":"):
        # Only the entry named after this store: a unit's process asking about another store
        # (or a unit with an unrelated RuntimeDirectory=) falls through to the next rules.
        if entry and Path(entry).name == store:
            return RunDir(Path(entry), "RUNTIME_DIRECTORY")
    if _owned_dir(system_root / store, uid):
        return RunDir(system_root / store, "system")
    if env.get("XDG_RUNTIME_DIR"):
        return RunDir(Path(env["XDG_RUNTIME_DIR"]) / "slidedp" / store, "XDG_RUNTIME_DIR")
    return RunDir(Path(f"/tmp/slidedp-{os.getuid()}") / store, "tmp")


def run_dir(store: str, create: bool = True) -> Path:
    """The store's private run directory (0700), created if asked."""
    path = resolve_run_dir(store).path
    if create:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.stat()
        if st.st_uid != os.geteuid():
            raise PermissionError(
                f"run directory {path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}): "
                f"run as its owner (see docs/operations.md, 'Who runs jobs')"
            )
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(path, 0o700)
    return path


def socket_address(store: str, name: str) -> str:
    """ZeroMQ ipc:// address of one of the store's sockets (inside the 0700 run dir)."""
    return f"ipc://{run_dir(store) / name}.sock"
