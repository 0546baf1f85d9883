#!/usr/bin/env bash
# The committed step of a session's persistent store, 0 while it does not exist: where the next run
# starts, so that train.steps = this + the run's steps.
#   bash benchmarks/sessions/committed_step.sh STORE
python3 -m slidedp.launch.store_cli status "$1" --json | python3 -c 'import json, sys; print(json.load(sys.stdin).get("committed_step", 0))'
