#!/usr/bin/env bash
# The `gpu`-marked tests on the GPU machine, written to OUT/gpu-tests.txt.
#   bash benchmarks/sessions/gpu_tests.sh OUT [pytest args]   (default: every gpu test under tests/)
# The project is installed into /tmp/site (the device command's header does it). Run from the
# checkout, `python -m pytest` puts its folder first on sys.path, and the checkout's slidedp/ (which
# has no slidedp.launch: that is launch/, mapped at install) shadows the installed package: so the
# tests run from a copy of the checkout without its package folders (slidedp/, launch/, daemons/).
set -u
mkdir -p "$1" && out=$(cd "$1" && pwd) || exit 2
shift
top=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d /tmp/gpu-tests.XXXX)
trap 'rm -rf "$work"' EXIT
(cd "$top" && tar --exclude=./slidedp --exclude=./launch --exclude=./daemons --exclude=./.git --exclude='./.whl*' \
  --exclude=./.venv -cf - .) | tar -xf - -C "$work" || { echo "gpu_tests: copying the checkout failed" >&2; exit 2; }
cd "$work" || exit 2
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(tests)
# unbuffered, a line per test: a call that stops it at its time limit still brings back what ran
python3 -u -m pytest -v -rA --durations=15 -m gpu -p no:randomly "${args[@]}" > "$out/gpu-tests.txt" 2>&1
rc=$?
tail -15 "$out/gpu-tests.txt"
exit $rc
