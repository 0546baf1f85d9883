"""A checkpoint written while training goes on holds exactly the state of its step.

The host-state daemon marks every chunk, copies them in store order and releases each as it
goes; an updater about to overwrite a chunk waits for its release (Manifest.wait_snapshot).
Here a thread plays the updater, rewriting every chunk in backward order (the last chunk,
copied last, first) as soon as it may: the checkpoint must still equal the state before any
rewrite, bit for bit, and the store must end with every rewrite applied.
"""

from __future__ import annotations

import math
import threading

import torch

from slidedp.store.service import HostStateCore
from slidedp.model import hf
from slidedp.store import checkpoint as ckpt
from slidedp.store.shm import unlink_store
from slidedp.store.store import STATE_KINDS

from . import unique_store


def test_background_checkpoint_is_the_state_of_its_step(tmp_path):
    store_name = unique_store("ckbg")
    core = HostStateCore(store_name)
    try:
        core.do_create({"source": "random", "shape": "small", "init_seed": 3})
        store = core.store
        for kind in ("exp_avg", "exp_avg_sq"):
            store.flat(kind).copy_(torch.randn(store.layout.total_numel))
        before = {k: store.flat(k).clone() for k in STATE_KINDS}

        out = core.do_checkpoint({"dir": str(tmp_path / "ck"), "dtype": "fp32", "background": True})
        assert out == {"step": 0, "background": True}

        m = store.manifest

        def updater() -> None:  # what slidedp-updater does before it writes a chunk
            for chunk in reversed(store.layout.chunks):
                m.wait_snapshot(chunk.id, timeout_s=60)
                for kind in STATE_KINDS:
                    store.chunk(kind, chunk).add_(1.0)

        t = threading.Thread(target=updater)
        t.start()
        done = core.do_checkpoint_wait({})
        t.join(60)
        assert not t.is_alive()
        assert (m.snapshot == 0).all()

        path = tmp_path / "ck" / "step-00000000"
        assert done == {"path": str(path), "step": 0}
        record = ckpt.read_record(path)
        assert record["master_in"] == "state"
        for span in store.layout.tensors:
            n = math.prod(span.shape)
            for kind in STATE_KINDS:
                want = before[kind][span.offset:span.offset + n].view(span.shape)
                assert torch.equal(hf.load_tensor(path / "state", f"{kind}.{span.name}"), want), (kind, span.name)
            # the Hugging Face folder is written from the copy, not from the store that moved on
            want = before["master"][span.offset:span.offset + n].view(span.shape)
            assert torch.equal(hf.load_tensor(path / "model", span.name), want), span.name
        for kind in STATE_KINDS:  # and every rewrite landed in the store afterwards
            assert torch.equal(store.flat(kind), before[kind] + 1.0)
        assert core.do_checkpoint_wait({}) == {"idle": True}
    finally:
        core.close()
        unlink_store(store_name)
