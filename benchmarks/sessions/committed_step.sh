#!/usr/bin/env bash
# The committed step of a session's persistent store, 0 while it does not exist: where the next run
# starts, so that train.steps = this + the run's steps.
#   bash benchmarks/sessions/committed_step.sh STORE
# (the console script, not `python3 -m slidedp...`: run from the checkout, -m would find its
# uninstalled slidedp/ first, which lacks the launch package)
slidedp-store status "$1" --json 2>/dev/null | python3 -c 'import json, sys
try:
    print(json.load(sys.stdin).get("committed_step", 0))
except ValueError:
    print(0)'
