#!/usr/bin/env bash
# Set up and run the test suite (GPU tests skip cleanly without CUDA; `-m slow` runs the long ones).
set -euo pipefail
cd "$(dirname "$0")/.."
# the suite starts hundreds of processes (launchers, daemons, workers), each importing SlideDP: where the
# environment forbids bytecode caches, each would compile its sources again (__pycache__ is git-ignored);
# with caches allowed, pip need not compile what it installs (the first process to import a module does)
unset PYTHONDONTWRITEBYTECODE
SLIDEDP_SETUP_NO_COMPILE=1 bash scripts/setup.sh
if [ "$(id -u)" = 0 ] || [ "${CI:-}" = true ]; then
  bash scripts/install-systemd-tools.sh   # systemd-analyze, for the unit-file tests
fi
.venv/bin/ruff check .   # errors only: pyproject.toml [tool.ruff]
exec .venv/bin/python -m pytest -q "$@"
