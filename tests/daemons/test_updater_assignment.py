"""Which updater process owns which chunk: contiguous ranges balanced over the host's work."""

from __future__ import annotations

from slidedp.daemons.aggregator.core import assign_updaters
from slidedp.jobrecord import held_chunk_ids, held_unit_names
from slidedp.stepplan import StepPlan
from slidedp.model.config import named_shape
from slidedp.store.layout import make_layout


def host_loads(layout, owner, count, held=frozenset()):
    loads = [0] * count
    for c, u in zip(layout.chunks, owner):
        if c.id not in held:
            loads[u] += c.numel
    return loads


def test_ranges_are_contiguous_and_balanced_over_what_the_host_updates():
    q4 = named_shape("qwen3-4b")
    layout = make_layout(q4)
    for count in (1, 2, 4):
        owner = assign_updaters(layout, count)
        assert owner == sorted(owner) and set(owner) == set(range(count))
        loads = host_loads(layout, owner, count)
        assert max(loads) <= 1.15 * sum(loads) / count
    # the first 10 layers and the embedding held on the devices: the rest is shared out evenly
    held = frozenset(held_chunk_ids(layout, held_unit_names(q4, StepPlan(embedding="device", device_layers=10))))
    assert len(held) == 10 + len(layout.chunks_of("embed"))
    for count in (2, 4):
        owner = assign_updaters(layout, count, held)
        loads = host_loads(layout, owner, count, held)
        assert owner == sorted(owner)
        assert max(loads) <= 1.15 * sum(loads) / count, loads  # was 1.54x the fair share with 4 updaters
        naive = host_loads(layout, assign_updaters(layout, count), count, held)
        assert max(loads) < max(naive)
