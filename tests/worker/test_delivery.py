"""What a fetch delivers: the fp32 master cast on the device, or the store's bf16 shadow, the same bits.

In-process on a real store in shared memory (a tiny random model, with and without the shadow); the
whole-run equivalence of the two deliveries is tests/pipeline/test_bf16_delivery.py.
"""

from __future__ import annotations

import pytest
import torch

from slidedp.model.config import named_shape
from slidedp.stepplan import StepPlan
from slidedp.store.layout import make_layout, units_of
from slidedp.store.store import HostStore, fill_random
from slidedp.worker.core import check_delivery
from slidedp.worker.delivery import ParamDelivery

from pipeline.harness import unique_store


@pytest.fixture
def stores():
    made: list[HostStore] = []

    def make(shadow: bool) -> HostStore:
        made.append(HostStore.create(unique_store("dl"), make_layout(named_shape("tiny", 512)), {"source": "random"},
                                     shadow=shadow, fill=fill_random(0)))
        return made[-1]

    yield make
    for s in made:
        s.destroy()


def test_the_shadow_delivers_the_bits_the_cast_of_the_master_makes(stores):
    store = stores(shadow=True)
    cpu, waits = torch.device("cpu"), []
    cast = ParamDelivery(store.flat("master"), cpu, torch.bfloat16, lambda u, s: waits.append((u.name, s)))
    shadow = ParamDelivery(store.flat("shadow"), cpu, torch.bfloat16, lambda u, s: waits.append((u.name, s)))
    units = units_of(store.layout)
    for name in ("embed", "layer.0", "layer.1", "norm"):
        a, b = cast.fetch(units[name], 0), shadow.fetch(units[name], 0)
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16)), name
    assert cast.h2d_bytes == 2 * shadow.h2d_bytes  # half the bytes cross
    assert waits == [(n, 0) for n in ("embed", "layer.0", "layer.1", "norm") for _ in range(2)]  # both wait on versions
    # after an update the shadow is refreshed with the master, before the version goes up (as the updater does)
    c = store.layout.chunks[units["layer.0"].chunks[0].id]
    store.chunk("master", c).mul_(1.5)
    store.refresh_shadow(c)
    a, b = cast.fetch(units["layer.0"], 1), shadow.fetch(units["layer.0"], 1)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    with pytest.raises(ValueError, match="the bf16 shadow delivery needs compute_dtype bf16"):
        ParamDelivery(store.flat("shadow"), cpu, torch.float32, lambda u, s: None)


def test_a_plan_delivering_bf16_is_refused_on_a_store_without_the_shadow(stores):
    store = stores(shadow=False)
    check_delivery(StepPlan(delivery="fp32"), store)
    with pytest.raises(RuntimeError, match=rf"store {store.name!r} was created without one: create it with "
                                           r"store.shadow_bf16 = true"):
        check_delivery(StepPlan(delivery="bf16"), store)
