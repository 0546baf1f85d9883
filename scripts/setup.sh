#!/usr/bin/env bash
# Create ./.venv and install SlideDP with its test extras. Idempotent; safe to re-run.
# SLIDEDP_TORCH picks the torch requirement (default: torch==2.13.0, a CPU build that this
# workplace's machines carry on disk; on a GPU host use the CUDA build you want).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
# pip byte-compiles every file it installs, torch's and transformers' thousands that are mostly never imported
# (36 s of a 2-core machine); SLIDEDP_SETUP_NO_COMPILE=1 (scripts/test.sh) skips it, and the processes write
# the caches of what they import
COMPILE=--compile
[ "${SLIDEDP_SETUP_NO_COMPILE:-}" = 1 ] && COMPILE=--no-compile
if ! "$VPY" -c "import torch" 2>/dev/null; then
  echo "setup: installing ${SLIDEDP_TORCH:-torch==2.13.0}"
  "$VPY" -m pip install -q --disable-pip-version-check $COMPILE "${SLIDEDP_TORCH:-torch==2.13.0}" 2>&1 | grep -v "^WARNING: Location" || true
  "$VPY" -c "import torch" || { echo "setup: torch did not install" >&2; exit 1; }
fi
echo "setup: installing slidedp and its test extras"
"$VPY" -m pip install -q --disable-pip-version-check $COMPILE -e ".[test,report]" 2>&1 | grep -v "^WARNING: Location" || true
"$VPY" -c "import slidedp, torch, zmq, posix_ipc, transformers; print('setup: ok (torch', torch.__version__ + ')')"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git config core.hooksPath .githooks   # .githooks/commit-msg: subjects of at most 72 characters
fi
