"""Setup for the tests of the benchmark scripts: the suite's own (tests/conftest.py: a private run root for
sockets, a calibration cache of the suite's, SIGTERM unwinding the running test, GPU tests skipped without
CUDA), and the repository root on sys.path, since benchmarks/ is not an installed package.

tests/conftest.py is loaded by its path rather than copied, so the two stay one setup. When `pytest` runs
the whole suite it has loaded that file already (testpaths lists tests/ first); the module it made is
reused so the suite keeps one run root."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _suite_conftest():
    path = ROOT / "tests" / "conftest.py"
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) == str(path):
            return module
    spec = importlib.util.spec_from_file_location("slidedp_suite_conftest", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_suite = _suite_conftest()
_sigterm_unwinds_the_test = _suite._sigterm_unwinds_the_test  # autouse fixtures reach only their own folder
pytest_collection_modifyitems = _suite.pytest_collection_modifyitems  # twice where both load: the same skips
