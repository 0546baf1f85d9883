"""The host store: one authoritative copy of the training state in POSIX shared memory.

`shm` maps the segments (0600, named slidedp.<store>.*), `layout` cuts the model into chunks,
`store` holds master weights and AdamW moments, `manifest` each chunk's version and the store's
state, `rings` the ranks' gradient slots, `checkpoint` writes and restores checkpoints; `service`
is the store's requests (create, attach, checkpoint, restore, destroy), which the host-state
daemon serves, and `client` sends them (to the daemon, or served in-process when none runs).
`layout` also groups chunks into the units a fetch delivers and views them as tensors; `hostmem`
registers the store's memory with CUDA and `host_rows` reads an embedding's rows from it in place.
"""
