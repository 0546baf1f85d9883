"""SlideDP: full-parameter fine-tuning from host memory across the GPUs of one machine.

The library every process shares. `store/` is the one authoritative copy of the training state
in POSIX shared memory (layout, manifest, gradient rings, checkpoints, and the store's service,
which the host-state daemon serves); `worker/` is the process that runs the step on a device;
`planner/` predicts a step and picks the plan that fits a memory budget; `model/` is the
decoder family's math and its Hugging Face folders; `data/` reads the training data (token files,
records, chat, documents packed into rows) into batches. Beside them: the job file (`config`),
the step plan every process carries out (`stepplan`), the job record the daemons
take (`jobrecord`), the messages (`protocol`) and their sockets (`transport`), and small pieces
of plumbing (`paths`, `daemonlock`, `numa`, `log`, `tracing`, `stopflag`, `schedule`). The
daemons are `slidedp.daemons` and the launcher `slidedp.launch` (folders daemons/ and launch/).
"""

__version__ = "0.1.0"
