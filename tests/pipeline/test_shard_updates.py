"""Reduce-scattered gradients are updated where they lie.

With the reduce_scatter route and no clipping, each rank's slot holds its shard of the summed
gradient. The aggregator copies nothing: it hands the chunk's updater one Update per rank, the
updater runs AdamW once every shard is there (each shard read in its rank's slot), and only then
do the ranks get their slots back. Driven in-process on a real store and real rings.
"""

from __future__ import annotations

import math

import pytest
import torch

from slidedp.store.layout import Shard
from slidedp.daemons.aggregator.core import AggregatorCore
from slidedp.daemons.updater.core import UpdaterCore
from slidedp.protocol import SOURCE_RANK_SHARD, Credit, Grad, Ready, Update
from slidedp.schedule import lr_at
from slidedp.store.store import STATE_KINDS
from slidedp.transport import identity

from reliability import drop_store
from .harness import attached_job_record, unique_store

def _expected(store, chunk, grad: torch.Tensor, lr: float, train) -> dict[str, torch.Tensor]:
    """torch.optim.AdamW's first step on every member of the chunk, from the store's current state."""
    out = {k: store.chunk(k, chunk).clone() for k in STATE_KINDS}
    for mb in chunk.members:
        sl = slice(mb.offset, mb.offset + mb.numel)
        p = torch.nn.Parameter(out["master"][sl].clone())
        p.grad = grad[sl].clone()
        opt = torch.optim.AdamW([p], lr=lr, betas=(train.beta1, train.beta2), eps=train.eps,
                                weight_decay=train.weight_decay if mb.decay else 0.0, foreach=False)
        opt.step()
        state = opt.state[p]
        out["master"][sl], out["exp_avg"][sl], out["exp_avg_sq"][sl] = p.detach(), state["exp_avg"], state["exp_avg_sq"]
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_updater_reads_each_ranks_shard_in_its_slot(world):
    store_name = unique_store("shards")
    try:
        record = attached_job_record(store_name, world, clip=False, grad_route="reduce_scatter")
        agg, upd = AggregatorCore(store_name), UpdaterCore(store_name, 0)
        agg.start_job(record, 1)
        upd.start_job(record)
        try:
            store, rings = agg.store, agg.rings
            chunk = max(store.layout.chunks, key=lambda c: len(c.members))  # shards cut across members
            assert len(chunk.members) > world
            full = torch.randn(chunk.numel, generator=torch.Generator().manual_seed(world))
            want = _expected(store, chunk, full, lr_at(record.train_section, 0), record.train_section)
            slots = [(2 * r + 1) % rings.slots for r in range(world)]  # each rank another slot
            out = []
            # slots sized for shards: each rank's rings take 1/N of the host route's
            assert rings.slot_numel == -(-store.layout.max_chunk_numel // world)
            with pytest.raises(ValueError, match="do not fit a gradient slot"):
                rings.slot(0, 0, chunk.numel)
            assert rings.slot(0, 0, 0).numel() == 0  # a rank whose shard of a small chunk is empty
            for r in range(world):
                sh = Shard(chunk.numel, world, r)
                buf = rings.slot(r, slots[r])
                buf.fill_(math.nan)  # past its shard a rank's slot holds nothing the update may read
                buf[:sh.end - sh.start] = full[sh.start:sh.end]  # the shard lands at the slot's start
                out += agg.on_grad(Grad(r, chunk.id, 0, slots[r], float(full[sh.start:sh.end].square().sum())))
            updates = [m for _, m in out if isinstance(m, Update)]
            assert [(u.source, u.rank, u.slot) for u in updates] == [(SOURCE_RANK_SHARD, r, slots[r]) for r in range(world)]
            assert not [m for _, m in out if isinstance(m, Credit)]  # the slots stay taken until the update
            assert agg.steps[0].reduce_s == 0.0  # nothing copied
            assert agg.steps[0].sqnorm == pytest.approx(float(full.square().sum()), rel=1e-5)

            for u in updates[:-1]:  # the chunk waits for every rank's shard
                upd.on_update(u)
                assert upd.next() is None
                assert store.manifest.versions[chunk.id] == 0
            upd.on_update(updates[-1])
            done = upd.next()
            assert done is not None and upd.next() is None
            assert store.manifest.versions[chunk.id] == 1 and store.manifest.adam_steps[chunk.id] == 1
            for k in STATE_KINDS:
                got = store.chunk(k, chunk)
                assert torch.isfinite(got).all(), k
                torch.testing.assert_close(got, want[k], rtol=1e-6, atol=1e-9, msg=k)

            back = agg.on_updated(done)
            credits = sorted((to, m.rank, m.slot) for to, m in back if isinstance(m, Credit))
            assert credits == [(identity("w", r), r, slots[r]) for r in range(world)]
            assert sorted(to for to, m in back if isinstance(m, Ready)) == [identity("w", r) for r in range(world)]
            assert not agg.shard_slots
            with pytest.raises(ValueError, match="never handed out"):  # a second Updated: logged and dropped
                agg.on_updated(done)
        finally:
            upd.end_job()
            agg.end_job()
    finally:
        drop_store(store_name)


def test_reduction_slots_only_where_the_aggregator_sums():
    from slidedp.jobrecord import reduction_slots
    from slidedp.store.rings import rings_bytes

    assert [reduction_slots(w, r) for w, r in ((1, "host"), (2, "host"), (4, "host"), (4, "reduce_scatter"))] == [0, 3, 3, 0]
    # what that saves on Qwen3-4B with 4 ranks: 3 chunk-sized fp32 slots, about 1.1 GiB of shared memory
    from slidedp.model.config import named_shape
    from slidedp.store.layout import make_layout

    layout = make_layout(named_shape("qwen3-4b"))
    _, summed = rings_bytes(layout, 4, 12, reduction_slots(4, "host"), False)
    _, sharded = rings_bytes(layout, 4, 12, reduction_slots(4, "reduce_scatter"), False)
    assert summed - sharded == 3 * layout.max_chunk_numel * 4
    assert 1.0 < (summed - sharded) / 2**30 < 1.3
    # and each rank's slots hold its shard: the ranks' rings together as large as one rank's, for any N
    one, _ = rings_bytes(layout, 1, 12, 0, False)
    for world in (2, 4, 8):
        whole, _ = rings_bytes(layout, world, 12, 0, False)
        shards, _ = rings_bytes(layout, world, 12, 0, False, shard_slots=True)
        assert whole - 4096 == world * (one - 4096)
        assert 0 <= shards - one <= 12 * world * 4  # ceil(chunk / N): a few elements of padding per slot
