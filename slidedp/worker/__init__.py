"""The worker: one process per device (rank) that runs the training step.

`shell` owns the process (argv, CPU affinity, signals, sockets) and `core` the step loop;
`link` is the core's view of the other processes (versions, gradient slots, loss agreement);
`engine` runs one step layer by layer, fed by `delivery` (parameters in, gradients out),
`device_state` (units held on the device for the whole job), `activations` (saved layer
inputs, some offloaded to host memory) and `collectives` (the sharded routes); `feed` hands the
engine a rank's share of rows of documents, and `evaluate` runs the forward-only eval loss on
them. The loss is the model's (`slidedp/model/loss.py`), and the store's memory as the device
sees it (registered with CUDA, an embedding's rows read in place) is the store's
(`slidedp/store/hostmem.py`, `host_rows.py`).
"""
