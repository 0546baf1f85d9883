"""The repository's commit-msg hook (.githooks/commit-msg, installed by scripts/setup.sh): a subject over
72 characters is refused with a message saying so; one of 72 passes, whatever the body holds."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

HOOK = Path(__file__).resolve().parents[1] / ".githooks" / "commit-msg"


def _repo(tmp_path: Path) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    for key, value in (("user.name", "t"), ("user.email", "t@example.com"), ("core.hooksPath", str(HOOK.parent))):
        subprocess.run(["git", "-C", str(repo), "config", key, value], check=True)
    (repo / "f").write_text("x\n")
    subprocess.run(["git", "-C", str(repo), "add", "f"], check=True)
    return repo


def _commit(repo: Path, message: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), "commit", "-q", "-m", message], capture_output=True, text=True)


def test_a_subject_over_72_characters_is_refused(tmp_path):
    repo = _repo(tmp_path)
    done = _commit(repo, "A" * 73 + "\n\nbody")
    assert done.returncode != 0
    assert "the subject is 73 characters; keep it to 72" in done.stderr
    assert subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True).returncode != 0


def test_a_subject_of_72_characters_with_a_long_body_passes(tmp_path):
    repo = _repo(tmp_path)
    done = _commit(repo, "B" * 72 + "\n\n" + "a body line that is much longer than seventy-two characters " * 3)
    assert done.returncode == 0, done.stderr
    log = subprocess.run(["git", "-C", str(repo), "log", "--format=%s"], capture_output=True, text=True).stdout
    assert log == "B" * 72 + "\n"


def test_setup_installs_the_hook():
    setup = (HOOK.parents[1] / "scripts" / "setup.sh").read_text()
    assert "git config core.hooksPath .githooks" in setup
