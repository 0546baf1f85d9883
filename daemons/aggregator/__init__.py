"""slidedp-aggregator: sums the ranks' gradients per chunk and hands each chunk to the updater pool."""
