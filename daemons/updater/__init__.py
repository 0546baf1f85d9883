"""slidedp-updater: the pool of NUMA-pinned processes that run AdamW on chunks as their gradients complete."""
