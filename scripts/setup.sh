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
COMPILE=--compile UV_COMPILE=--compile-bytecode
[ "${SLIDEDP_SETUP_NO_COMPILE:-}" = 1 ] && COMPILE=--no-compile UV_COMPILE=
# uv resolves and installs the ~60 packages in about a third of pip's time (23 s against 74 s on 2 cores), from
# the sources pip is configured with (scripts/pip_sources.py); pip where uv does not install or fails, or
# with SLIDEDP_SETUP_PIP=1
install() {
  if [ "${SLIDEDP_SETUP_PIP:-}" != 1 ] && "$VPY" -m pip install -q --disable-pip-version-check uv >/dev/null 2>&1; then
    local sources
    mapfile -t sources < <("$VPY" scripts/pip_sources.py)
    # shellcheck disable=SC2086
    "$VPY" -m uv pip install -q --python "$VPY" $UV_COMPILE "${sources[@]}" "$@" && return
    echo "setup: uv could not install; pip instead" >&2
  fi
  # pip's own status (pipefail), not grep's: a failed install stops here, naming what it was asked for
  "$VPY" -m pip install -q --disable-pip-version-check $COMPILE "$@" 2>&1 | { grep -v "^WARNING: Location" || true; } \
    || { echo "setup: pip could not install $*" >&2; exit 1; }
}
TORCH=()
if ! "$VPY" -c "import torch" 2>/dev/null; then
  TORCH=("${SLIDEDP_TORCH:-torch==2.13.0}")
  echo "setup: installing ${TORCH[0]}"
fi
echo "setup: installing slidedp and its test extras"
install "${TORCH[@]}" -e ".[test,report]"
"$VPY" -c "import slidedp, torch, zmq, posix_ipc, transformers; print('setup: ok (torch', torch.__version__ + ')')" \
  || { echo "setup: .venv lacks a package (named above); re-run with SLIDEDP_SETUP_PIP=1 to see pip's errors" >&2; exit 1; }
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git config core.hooksPath .githooks   # .githooks/commit-msg: subjects of at most 72 characters
fi
