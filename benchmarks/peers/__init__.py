"""The systems the harness measures, one module each, each runnable alone (`python -m benchmarks.peers.X`)."""
