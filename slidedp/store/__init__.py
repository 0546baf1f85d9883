"""The host store: POSIX shared memory segments, manifest, chunk table."""
