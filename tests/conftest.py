"""Shared test setup: every process of the suite keeps its sockets under one private run root, and
its host calibrations in a cache of its own (one measured while the suite loads the host must not
be charged to the user's plans). A SIGTERM to the suite unwinds the running test as Ctrl-C does."""

from __future__ import annotations

import os
import signal
import tempfile

import pytest
import torch

_RUN_ROOT = tempfile.mkdtemp(prefix="slidedp-test-run-")
os.environ["SLIDEDP_RUN_ROOT"] = _RUN_ROOT
os.environ["SLIDEDP_CACHE_DIR"] = os.path.join(_RUN_ROOT, "cache")
os.environ.setdefault("SLIDEDP_LOG_LEVEL", "WARNING")
torch.set_num_threads(2)


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"pytest got {signal.Signals(signum).name}")


@pytest.fixture(autouse=True)
def _sigterm_unwinds_the_test():
    """SIGTERM (a CI or session limit, `timeout`) would end pytest at once, skipping the running test's
    finally blocks: a store the test made for itself stayed in /dev/shm. As a KeyboardInterrupt it unwinds
    the test and its fixtures. Set before every test: a launcher's main() run in-process sets its own."""
    signal.signal(signal.SIGTERM, _interrupted)
    yield


@pytest.fixture(scope="session")
def family_folders(tmp_path_factory):
    """Each family's tiny folder (tests/families.py, seed 4) for the launched tests, written once per session
    on first use: test_layer_chunks reads gpt-oss's run of test_family_equivalence (family_run)."""
    from families import FamilyFolders

    return FamilyFolders(tmp_path_factory.mktemp("families"), seed=4)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
