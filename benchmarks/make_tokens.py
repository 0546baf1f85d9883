"""Write random token ids for the benchmark jobs: python -m benchmarks.make_tokens OUT.npy VOCAB COUNT."""

import sys

import numpy as np

if __name__ == "__main__":
    out, vocab, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    np.save(out, np.random.default_rng(0).integers(0, vocab, size=count, dtype=np.int64).astype(np.int32))
    print(f"wrote {count} random token ids < {vocab} to {out}")
