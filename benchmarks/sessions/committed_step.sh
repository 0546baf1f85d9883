#!/usr/bin/env bash
# The committed step of a session's persistent store, 0 while it does not exist: where the next run
# starts, so that train.steps = this + the run's steps.
#   bash benchmarks/sessions/committed_step.sh STORE
# Read straight from the store's manifest segment (no daemon request: a request that failed or timed
# out read as 0 and made the next run find nothing to train). Why it printed 0 goes to stderr.
python3 - "$1" <<'PY'
import sys
from slidedp.store.manifest import Manifest
from slidedp.store.shm import segment_name
try:
    m = Manifest.open(segment_name(sys.argv[1], "manifest"))
except FileNotFoundError:
    print(0)
else:
    print(m.committed_step)
    m.close()
PY
