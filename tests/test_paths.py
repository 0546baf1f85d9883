"""The run directory's resolution order (slidedp/paths.py), rule by rule, with temp dirs and explicit environments."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from slidedp.paths import resolve_run_dir, run_dir

STORE = "demo"
UID = os.geteuid()


@pytest.fixture
def system_root(tmp_path: Path) -> Path:
    """A stand-in for /run/slidedp with the store's directory in it, owned by this user."""
    root = tmp_path / "run-slidedp"
    (root / STORE).mkdir(parents=True, mode=0o700)
    return root


def resolve(env: dict[str, str], system_root: Path, uid: int = UID):
    return resolve_run_dir(STORE, environ=env, system_root=system_root, uid=uid)


def test_order_each_rule_wins_over_the_later_ones(tmp_path: Path, system_root: Path) -> None:
    env = {
        "SLIDEDP_RUN_ROOT": str(tmp_path / "explicit"),
        "RUNTIME_DIRECTORY": f"{tmp_path}/other:{tmp_path}/units/{STORE}",
        "XDG_RUNTIME_DIR": str(tmp_path / "xdg"),
    }
    expected = [
        ("SLIDEDP_RUN_ROOT", tmp_path / "explicit" / STORE),
        ("RUNTIME_DIRECTORY", tmp_path / "units" / STORE),
        ("system", system_root / STORE),
        ("XDG_RUNTIME_DIR", tmp_path / "xdg" / "slidedp" / STORE),
        ("tmp", Path(f"/tmp/slidedp-{os.getuid()}") / STORE),
    ]
    for rule, path in expected:
        got = resolve(env, system_root)
        assert (got.rule, got.path) == (rule, path)
        # Take away what this rule used: the next rule must answer.
        if rule == "SLIDEDP_RUN_ROOT":
            del env["SLIDEDP_RUN_ROOT"]
        elif rule == "RUNTIME_DIRECTORY":
            del env["RUNTIME_DIRECTORY"]
        elif rule == "system":
            (system_root / STORE).rmdir()
        elif rule == "XDG_RUNTIME_DIR":
            del env["XDG_RUNTIME_DIR"]


def test_empty_variables_count_as_unset(tmp_path: Path) -> None:
    env = {"SLIDEDP_RUN_ROOT": "", "RUNTIME_DIRECTORY": "", "XDG_RUNTIME_DIR": str(tmp_path)}
    assert resolve(env, tmp_path / "absent").rule == "XDG_RUNTIME_DIR"


def test_runtime_directory_of_another_store_is_not_used(tmp_path: Path) -> None:
    """A process of unit slidedp-hoststate@other asking about store 'demo' must not take other's directory."""
    env = {"RUNTIME_DIRECTORY": f"{tmp_path}/slidedp/other", "XDG_RUNTIME_DIR": str(tmp_path / "xdg")}
    got = resolve(env, tmp_path / "absent")
    assert (got.rule, got.path) == ("XDG_RUNTIME_DIR", tmp_path / "xdg" / "slidedp" / STORE)


def test_user_unit_and_manual_client_agree(tmp_path: Path) -> None:
    """Under `systemd --user`, RuntimeDirectory=slidedp/%i is $XDG_RUNTIME_DIR/slidedp/NAME: the same
    directory a client started by hand computes from $XDG_RUNTIME_DIR."""
    xdg = str(tmp_path / "xdg")
    daemon = resolve({"RUNTIME_DIRECTORY": f"{xdg}/slidedp/{STORE}", "XDG_RUNTIME_DIR": xdg}, tmp_path / "absent")
    client = resolve({"XDG_RUNTIME_DIR": xdg}, tmp_path / "absent")
    assert daemon.path == client.path and (daemon.rule, client.rule) == ("RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR")


def test_system_dir_of_another_user_is_skipped(tmp_path: Path, system_root: Path) -> None:
    env = {"XDG_RUNTIME_DIR": str(tmp_path / "xdg")}
    assert resolve(env, system_root, uid=UID).rule == "system"
    assert resolve(env, system_root, uid=UID + 1).rule == "XDG_RUNTIME_DIR"


def test_system_entry_that_is_not_a_directory_is_skipped(tmp_path: Path) -> None:
    root = tmp_path / "run-slidedp"
    root.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    (root / STORE).symlink_to(target)  # owned by us, but a link: never followed
    assert resolve({}, root).rule == "tmp"
    (root / STORE).unlink()
    (root / STORE).write_text("")
    assert resolve({}, root).rule == "tmp"


def test_bad_store_name_is_refused_before_any_path_is_built(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"store name '\.\./x' is not allowed"):
        resolve_run_dir("../x", environ={"SLIDEDP_RUN_ROOT": str(tmp_path)})


def test_run_dir_creates_a_private_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIDEDP_RUN_ROOT", str(tmp_path / "root"))
    store = f"p-{uuid.uuid4().hex[:8]}"
    assert not (tmp_path / "root" / store).exists()
    assert run_dir(store, create=False) == tmp_path / "root" / store
    assert not (tmp_path / "root" / store).exists()
    path = run_dir(store)
    assert path == tmp_path / "root" / store
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    os.chmod(path, 0o755)  # loosened by hand: tightened again on the next use
    run_dir(store)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700


def test_every_process_of_a_unit_resolves_the_same_directory(tmp_path: Path) -> None:
    """A child of a unit's process (an updater member, a worker) inherits the environment and agrees."""
    unit_dir = tmp_path / "slidedp" / STORE
    env = {k: v for k, v in os.environ.items() if k not in ("SLIDEDP_RUN_ROOT", "XDG_RUNTIME_DIR")}
    env["RUNTIME_DIRECTORY"] = str(unit_dir)
    code = f"from slidedp.paths import run_dir; print(run_dir({STORE!r}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(unit_dir)
    assert stat.S_IMODE(unit_dir.stat().st_mode) == 0o700
