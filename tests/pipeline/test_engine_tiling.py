"""The engine's step in-process on CPU: sequence tiling, activation offload and the prefetch depth
change no number.

A fake Link stands in for the daemons; gradients land in plain slot tensors, and a plain SGD
step between engine steps makes every step's parameters depend on the previous gradients.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

import pytest
import torch

from slidedp.worker.activations import SavedInputs
from slidedp.stepplan import StepPlan
from slidedp.worker.engine import Engine
from slidedp.model.config import NAMED_SHAPES, ModelConfig
from slidedp.model.init import init_tensor_
from slidedp.store.layout import Chunk, Layout, Unit, make_layout, unit_tensors, units_of

from .harness import rel_err

M, MB, T = 2, 2, 37  # micro-batches of MB sequences of T tokens; 7-token tiles divide neither T nor MB * T
STEPS = 3
LR = 0.5


class FakeLink:
    def __init__(self, slots: int) -> None:
        self.slots, self.next_slot = slots, 0
        self.landed: dict[int, tuple[int, float]] = {}  # chunk id -> (slot, squared norm)

    def wait_ready(self, unit, step: int) -> None:
        pass

    def acquire_slot(self, while_waiting) -> int:
        self.next_slot = (self.next_slot + 1) % self.slots
        return self.next_slot

    def grad_landed(self, chunk: Chunk, slot: int, sqnorm: float, step: int) -> None:
        self.landed[chunk.id] = (slot, sqnorm)

    def device_grad(self, chunk: Chunk, sqnorm: float, step: int) -> None:
        raise AssertionError("no device-held chunks here")

    def agree_loss(self, step: int, loss_sum: float, tokens: int, finite: bool, routing=None) -> bool:
        self.routing = routing  # one rank: its router statistics are the total
        return False

    def routing_total(self, step: int) -> tuple[float, ...]:
        return self.routing.values

    def wait_norm(self, step: int) -> float:
        return 0.0

    def norms_reported(self, step: int) -> None:
        pass


def initial_master(layout: Layout) -> torch.Tensor:
    master = torch.zeros(layout.total_numel)
    for span in layout.tensors:
        init_tensor_(span.name, master[span.offset:span.offset + math.prod(span.shape)].view(span.shape), seed=11)
    return master


def make_engine(cfg: ModelConfig, policy: StepPlan, link: FakeLink, held_layers: int = 0,
                held_kind: type | None = None) -> Engine:
    """An fp32 CPU engine over a fresh master, with one gradient slot per chunk (none reused in a step)
    and its first `held_layers` layers held (`held_kind`, by default HeldStandIn)."""
    layout = make_layout(cfg)
    master = initial_master(layout)
    units = units_of(layout)
    held = {f"layer.{i}": (held_kind or HeldStandIn)(master, units[f"layer.{i}"]) for i in range(held_layers)}
    slots = torch.zeros(len(layout.chunks), layout.max_chunk_numel)
    return Engine(cfg, layout, master, torch.device("cpu"), torch.float32, link,
                  lambda slot, numel: slots[slot, :numel], M * MB * T, policy, held=held)


def train(cfg: ModelConfig, policy: StepPlan, observe: Callable[[Engine], None] = lambda engine: None,
          ) -> tuple[list[float], list[dict[int, torch.Tensor]]]:
    """Losses and every chunk's gradient of STEPS engine steps with SGD between them (`observe` gets
    the engine before its first step)."""
    layout = make_layout(cfg)
    link = FakeLink(len(layout.chunks))
    engine = make_engine(cfg, policy, link)
    master, slot_view = engine.master, engine.grads.slot_view
    observe(engine)
    gen = torch.Generator().manual_seed(5)
    losses, grads = [], []
    for step in range(STEPS):
        seqs = torch.randint(0, cfg.vocab_size, (M, MB, T + 1), generator=gen)
        link.landed.clear()
        times = engine.run_step(step, seqs[..., :-1], seqs[..., 1:])
        assert not times.skipped and sorted(link.landed) == [c.id for c in layout.chunks]
        got = {}
        for c in layout.chunks:
            slot, sq = link.landed[c.id]
            got[c.id] = slot_view(slot, c.numel).clone()
            assert sq == pytest.approx(float(got[c.id].square().sum()), rel=1e-5)
        for c in layout.chunks:
            master[c.offset:c.offset + c.numel] -= LR * got[c.id]
        losses.append(times.loss_sum)
        grads.append(got)
    return losses, grads


@pytest.mark.parametrize("shape", ["tiny", "tiny-llama"])  # tied Qwen3 (qk norm), untied Llama
def test_tiling_and_offload_match_the_plain_step(shape):
    cfg = NAMED_SHAPES[shape]
    base_losses, base_grads = train(cfg, StepPlan())
    for policy in (StepPlan(seq_tile_tokens=7, offload_layers=2),
                   StepPlan(seq_tile_tokens=7, offload_layers=cfg.num_layers, resident_layers=1),
                   StepPlan(offload_layers=1)):
        losses, grads = train(cfg, policy)
        for step in range(STEPS):
            assert abs(losses[step] - base_losses[step]) < 1e-5 * base_losses[step], (policy, step)
            for cid, g in base_grads[step].items():
                assert rel_err(grads[step][cid], g) < 1e-5, (policy, step, cid)


def test_offload_only_is_exact():
    """Offloading moves the saved inputs, it computes nothing: bit-identical gradients."""
    cfg = NAMED_SHAPES["tiny"]
    base_losses, base_grads = train(cfg, StepPlan())
    losses, grads = train(cfg, StepPlan(offload_layers=cfg.num_layers))
    assert losses == base_losses
    assert all(torch.equal(grads[s][c], base_grads[s][c]) for s in range(STEPS) for c in base_grads[s])


def test_saved_inputs_reuse_the_host_buffer():
    saved = SavedInputs(torch.device("cpu"), offload_layers=2)
    xs = [[torch.randn(MB, T, 8) for _ in range(M)] for _ in range(3)]
    buffers = set()
    for step in range(2):
        saved.start(step, (M, MB, T, 8), torch.float32)
        for layer in range(3):
            for i, x in enumerate(xs[layer]):
                saved.save(layer, i, x)
        buffers.add(saved._host.data_ptr())
        assert saved._host.shape == (2, M, MB, T, 8)
        saved.prefetch(2)  # a kept layer: nothing to fetch
        for layer in reversed(range(3)):
            if layer:
                saved.prefetch(layer - 1)
            assert all(torch.equal(saved.get(layer, i), xs[layer][i]) for i in range(M))
            saved.release(layer)
    assert len(buffers) == 1


def test_policy_is_validated():
    with pytest.raises(ValueError, match="seq_tile_tokens"):
        StepPlan(seq_tile_tokens=-1)
    with pytest.raises(ValueError, match="prefetch_depth must be between 1 and 8, got 0"):
        StepPlan(prefetch_depth=0)
    cfg = NAMED_SHAPES["tiny"]
    layout = make_layout(cfg)
    with pytest.raises(ValueError, match="offload_layers"):
        Engine(cfg, layout, initial_master(layout), torch.device("cpu"), torch.float32, FakeLink(1),
               lambda slot, numel: None, 1, StepPlan(offload_layers=cfg.num_layers + 1))


def log_copies(engine: Engine, events: list[tuple[str, str, int]]) -> None:
    """Record ("issue" | "fetch", unit, step) for every parameter copy the engine starts or takes."""
    delivery = engine.delivery
    wait_ready, fetch = delivery.wait_ready, delivery.fetch

    def issuing(unit, step):
        events.append(("issue", unit.name, step))
        wait_ready(unit, step)

    def fetching(unit, step):
        events.append(("fetch", unit.name, step))
        return fetch(unit, step)

    delivery.wait_ready, delivery.fetch = issuing, fetching


@pytest.mark.parametrize("depth,resident", [(1, 0), (2, 0), (3, 2), (8, 0)])
def test_prefetch_depth_keeps_that_many_layer_copies_ahead(depth, resident):
    """Before a layer is taken, the copies of the next `depth` layers the pass fetches are running
    (never more); the numbers are those of the default depth, bit for bit."""
    cfg = replace(NAMED_SHAPES["tiny"], num_layers=6)
    base_losses, base_grads = train(cfg, StepPlan(resident_layers=resident))
    events: list[tuple[str, str, int]] = []
    losses, grads = train(cfg, StepPlan(prefetch_depth=depth, resident_layers=resident),
                          lambda engine: log_copies(engine, events))
    assert losses == base_losses
    assert all(torch.equal(grads[s][c], base_grads[s][c]) for s in range(STEPS) for c in base_grads[s])

    n = cfg.num_layers
    kept = set(range(n - resident, n))  # fetched in the forward only: the backward reuses them
    passes = {"forward": list(range(n)), "backward": [i for i in reversed(range(n)) if i not in kept]}
    for step in range(STEPS):
        layer_events = [(kind, int(name.split(".")[1])) for kind, name, s in events
                        if s == step and name.startswith("layer.")]
        split = len(passes["forward"]) * 2  # each forward layer is issued once and fetched once
        for pass_name, events_of_pass in (("forward", layer_events[:split]), ("backward", layer_events[split:])):
            order = passes[pass_name]
            assert sorted(i for kind, i in events_of_pass if kind == "fetch") == sorted(order), pass_name
            in_flight: list[int] = []
            for kind, layer in events_of_pass:
                if kind == "issue":
                    in_flight.append(layer)
                    assert len(in_flight) <= depth, (pass_name, step, in_flight)
                    continue
                at = order.index(layer)
                window = order[at:at + depth]
                if at == 0:  # the pass's first copies: started before it, as far as the kept layers allowed
                    assert in_flight and in_flight == window[:len(in_flight)], (pass_name, step, in_flight)
                else:
                    assert in_flight == window, (pass_name, step, layer, in_flight)
                in_flight.remove(layer)


class HeldStandIn:
    """A layer held on the device, as the engine uses one (its update is left out: these tests look
    at the order of the work, not at the numbers)."""

    rank = 0

    def __init__(self, master: torch.Tensor, unit: Unit) -> None:
        self.flat, self.unit = master[unit.offset:unit.offset + unit.numel], unit

    def tensors(self, strip: str = "") -> dict[str, torch.Tensor]:
        return unit_tensors(self.flat, self.unit, strip)

    def reduce(self, grad: torch.Tensor) -> float:
        return float(torch.dot(grad, grad))

    def update(self, grad: torch.Tensor, step: int, clip_coef: float | None) -> None:
        pass


class HeldLink(FakeLink):
    def device_grad(self, chunk: Chunk, sqnorm: float, step: int) -> None:
        pass


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_held_layers_are_queued_before_the_wait_for_the_first_fetched_layer(monkeypatch, depth):
    """The first fetched layer after the held ones is the one the host updates last: its copy (which
    waits for that update) starts only `depth` layers ahead, so the held layers before that point
    are already queued on the GPU while the host finishes."""
    import slidedp.model.layers as layers

    cfg, held = replace(NAMED_SHAPES["tiny"], num_layers=6), 3
    engine = make_engine(cfg, StepPlan(prefetch_depth=depth), HeldLink(len(make_layout(cfg).chunks)), held)
    events: list[tuple[str, str, int]] = []
    log_copies(engine, events)
    forward = layers.layer_forward

    def queued(*args, **kwargs):
        events.append(("compute", "", 0))
        return forward(*args, **kwargs)

    monkeypatch.setattr(layers, "layer_forward", queued)
    gen = torch.Generator().manual_seed(5)
    seqs = torch.randint(0, cfg.vocab_size, (M, MB, T + 1), generator=gen)
    engine.run_step(0, seqs[..., :-1], seqs[..., 1:])
    first_wait = events.index(("issue", f"layer.{held}", 0))
    assert sum(1 for e in events[:first_wait] if e[0] == "compute") == (held + 1 - depth) * M


def test_host_gradients_are_announced_before_the_held_layers_norms_wait_for_their_backward():
    """A held layer's norm waits for the GPU's backward of every held layer (on CUDA, a float of a
    device tensor). Every gradient sent to the host before then is announced before that wait, so the
    updaters start on the last fetched layers while the held layers' backward runs, not after it."""
    cfg, held = replace(NAMED_SHAPES["tiny"], num_layers=6), 3
    order: list[str] = []

    class OrderLink(HeldLink):
        def grad_landed(self, chunk: Chunk, slot: int, sqnorm: float, step: int) -> None:
            super().grad_landed(chunk, slot, sqnorm, step)
            order.append(f"landed {chunk.id}")

    class WaitingHeld(HeldStandIn):
        def reduce(self, grad: torch.Tensor) -> float:
            order.append("norm")
            return super().reduce(grad)

    layout = make_layout(cfg)
    engine = make_engine(cfg, StepPlan(), OrderLink(len(layout.chunks)), held, WaitingHeld)
    units = units_of(layout)
    seqs = torch.randint(0, cfg.vocab_size, (M, MB, T + 1), generator=torch.Generator().manual_seed(5))
    engine.run_step(0, seqs[..., :-1], seqs[..., 1:])
    held_ids = {c.id for i in range(held) for c in units[f"layer.{i}"].chunks}
    host_ids = sorted(c.id for c in layout.chunks if c.id not in held_ids)
    first_norm = order.index("norm")
    assert sorted(int(e.split()[1]) for e in order[:first_norm]) == host_ids
    assert order[first_norm:] == ["norm"] * held


def test_a_skipped_step_leaves_no_copy_behind():
    """The backward's first copy starts before the loss; a step the ranks skip never takes it."""

    class SkippingLink(FakeLink):
        def agree_loss(self, step: int, loss_sum: float, tokens: int, finite: bool, routing=None) -> bool:
            return True

    cfg = replace(NAMED_SHAPES["tiny"], num_layers=6)
    engine = make_engine(cfg, StepPlan(prefetch_depth=2), SkippingLink(len(make_layout(cfg).chunks)))
    events: list[tuple[str, str, int]] = []
    log_copies(engine, events)
    seqs = torch.randint(0, cfg.vocab_size, (M, MB, T + 1), generator=torch.Generator().manual_seed(5))
    assert engine.run_step(0, seqs[..., :-1], seqs[..., 1:]).skipped
    assert ("issue", "layer.5", 0) in events  # it was started ...
    assert engine.delivery.in_flight() == []  # ... and dropped
