"""The store's daemons (installed as slidedp.daemons): each a package with its core and its shell.

`hoststate/` owns a store and serves requests on its control socket (its logic is
slidedp.store.service); `aggregator/` sums the ranks' gradients per chunk and runs the job
handshake; `updater/` is the NUMA-pinned pool of processes that run AdamW. Every shell runs the
same loop (`loop.py`: wait, handle, watchdog, stop flag) and speaks systemd's readiness and
watchdog protocol (`sdnotify.py`).
"""
