"""One real tiny run shared by the UX tests: the launcher as a user runs it, output captured (not a terminal)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from slidedp.store.shm import list_store_segments, unlink_store

from pipeline.harness import TINY, unique_store

STEPS = 4
TRACED = 2


@dataclass(frozen=True)
class TinyRun:
    run_dir: Path
    store: str
    stdout: str
    stderr: str


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> TinyRun:
    """examples/tiny.toml for 4 steps with step 2 traced; INFO logs on so start-up messages show."""
    cwd = tmp_path_factory.mktemp("ux-run")
    store = unique_store("ux")
    run_dir = cwd / "run"
    argv = [sys.executable, "-m", "slidedp.launch.cli", str(TINY), "--set", f"train.steps={STEPS}",
            "--set", f'store.name="{store}"', "--set", f'run.dir="{run_dir}"', "--set", f'run.trace_steps="{TRACED}"']
    env = dict(os.environ, PYTHONUNBUFFERED="1", SLIDEDP_LOG_LEVEL="INFO")
    try:
        proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert store not in list_store_segments(), "the launcher left the store's segments behind"
    finally:
        unlink_store(store)
    return TinyRun(run_dir, store, proc.stdout, proc.stderr)
