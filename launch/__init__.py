"""The launcher and the command-line tools (installed as slidedp.launch).

`cli` is slidedp-launch's shell (argv); `jobrun` runs one job from start to end (store, daemons,
workers, checkpoints, teardown) with `steps` as its core (which steps are complete),
`admission` its decision on a job (store, host room, shadow, plan, resume point) and `planning`
making the job's step plan; `children` starts and stops child processes; `progress` writes
metrics.jsonl and the progress line; `dryrun` checks a job without starting it and prints the
same decision; `store_cli` is slidedp-store, `report` slidedp-report, `tracefile` the merged
trace.json.
"""
