"""The layer-major step of one rank: every local micro-batch through a chunk before the next chunk.

forward   embedding rows; for each layer: wait for its version, fetch (prefetching the
          next), run all micro-batches, keep each micro-batch's layer input (on the device,
          or offloaded to host memory for the first `offload_layers` layers)
loss      final norm + chunked cross-entropy (never the full logits), and its backward at
          once; the ranks agree the loss is finite before any gradient leaves (and, where the
          routers add their auxiliary loss, sum their statistics for the backward: router_aux.py)
backward  for each layer in reverse: fetch again, recompute from the saved input, backward,
          accumulate the chunk gradient in fp32 on the device, send it out
embedding its gradient (tied: plus the head's) goes out last
held      units the plan leases to the device (the first `device_layers` layers, a device
          embedding/head) come from their device copy, never wait for the host, and keep their
          gradient on the device; after backward it is reduced among ranks and updated there

Long sequences: with `seq_tile_tokens` > 0 the MLP halves of the layers and the final norm +
head run over tiles of that many tokens (see layers.layer_backward), so the GPU holds one
tile's MLP and logits activations; with offloaded inputs the sequence length is then bound
by host memory and by attention's own activations.

The engine knows nothing of sockets: the worker hands it a `Link` that waits on versions,
hands out gradient slots, announces landed gradients and runs the loss agreement.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import torch

from .. import faults
from .activations import SavedInputs
from ..clipping import Verdict
from .collectives import Group
from .delivery import GradOut, ParamDelivery
from .device_state import DeviceHeld
from ..model.attention import choose_backend, packed_rows, plain_rows, single_document
from ..model.config import ModelConfig
from ..model.family import ModelMath, NativeMath
from ..model.router_aux import RoutingShare
from ..data.targets import IGNORE_INDEX
from ..stepplan import StepPlan
from ..tracing import NULL, Tracer
from ..store.host_rows import HostRows
from ..store.layout import Chunk, Layout, Unit, unit_tensors, units_of


class Link(Protocol):
    def wait_ready(self, unit: Unit, step: int) -> None: ...
    def acquire_slot(self, while_waiting: Callable[[], None]) -> int: ...  # calls while_waiting as it waits
    def grad_landed(self, chunk: Chunk, slot: int, sqnorm: float, step: int) -> None: ...
    def device_grad(self, chunk: Chunk, sqnorm: float, step: int) -> None: ...  # a device-held chunk's norm
    def agree_loss(self, step: int, loss_sum: float, tokens: int, finite: bool,
                   routing: RoutingShare | None = None) -> bool: ...  # True: skip the step
    def routing_total(self, step: int) -> tuple[float, ...]: ...  # after agree_loss: every rank's statistics
    def wait_norm(self, step: int) -> float: ...  # the step's global gradient norm (exact clipping)
    def norms_reported(self, step: int) -> None: ...  # every gradient's norm of the step is reported


@dataclass
class StepTimes:
    forward_s: float = 0.0
    backward_s: float = 0.0
    loss_sum: float = 0.0
    tokens: int = 0
    skipped: bool = False
    extra: dict[str, float] = field(default_factory=dict)


class Engine:
    def __init__(self, cfg: ModelConfig, layout: Layout, master: torch.Tensor, device: torch.device,
                 dtype: torch.dtype, link: Link, slot_view, global_tokens: int, plan: StepPlan = StepPlan(),
                 max_grad_norm: float = 0.0, held: dict[str, DeviceHeld] | None = None, param_group: Group | None = None,
                 grad_group: Group | None = None, shadow: torch.Tensor | None = None,
                 math: ModelMath | None = None, rows_from_host: bool = True) -> None:
        """master: the store's flat fp32 master; shadow: its bf16 shadow, which the plan's delivery = "bf16"
        streams instead (the layers, the norm, the head and the host embedding's rows). math: the model's
        layers, embedding and loss (family.py; None: the native layers). rows_from_host: an embedding on the
        host gives the batch's rows from the store (False on several hosts, where no store holds every row:
        it is fetched whole, like the head)."""
        self.cfg, self.layout, self.master = cfg, layout, master
        self.math = math or NativeMath(cfg, device, dtype)
        if plan.delivery == "bf16" and shadow is None:
            raise ValueError("the plan delivers the bf16 shadow, and the store has none (store.shadow_bf16)")
        # what streams to the device; device-held units copy the fp32 master once (device_state.py)
        self.source = shadow if plan.delivery == "bf16" else master
        self.device, self.dtype, self.link, self.plan = device, dtype, link, plan
        self.max_grad_norm = max_grad_norm  # > 0: device-held chunks wait for the global norm before updating
        self.units = units_of(layout)
        self.held = held or {}  # unit name -> its device-held state ("layer.0".., "embed", "head" when untied)
        self.rows_from_host = rows_from_host
        self.delivery = ParamDelivery(self.source, device, dtype, link.wait_ready, param_group)
        self.grads = GradOut(device, slot_view, link.grad_landed, grad_group)  # groups set: the sharded routes
        self.scale = 1.0 / global_tokens  # loss = sum of token losses / global token count
        self._resident: dict[int, torch.Tensor] = {}
        self._host_rows: HostRows | None = None  # made at the first batch of a host-held embedding
        if plan.offload_layers > cfg.num_layers:
            raise ValueError(f"offload_layers ({plan.offload_layers}) exceeds the model's {cfg.num_layers} layers")
        self.saved = SavedInputs(device, plan.offload_layers)
        self.tracer: Tracer = NULL

    def set_tracer(self, tracer: Tracer) -> None:
        self.tracer = self.delivery.tracer = self.grads.tracer = self.saved.tracer = tracer

    @contextmanager
    def _span(self, name: str, step: int, **args) -> Iterator[None]:
        """A compute-track span: on CUDA the compute stream's time for the work queued in it (CUDA
        events, read after the step: nothing waits), on CPU the host's."""
        if not self.tracer.on(step):
            yield
        elif self.device.type == "cuda":
            with self.tracer.device_span(name, "compute", step, torch.cuda.current_stream(self.device), **args):
                yield
        else:
            with self.tracer.span(name, "compute", step, **args):
                yield

    # ---- helpers ---------------------------------------------------------------------------
    def _is_resident(self, layer: int) -> bool:
        return layer >= self.cfg.num_layers - self.plan.resident_layers

    def _fetched(self, layer: int, backward: bool) -> bool:
        """Whether the layer comes from the host in this pass (not held, not kept from the forward)."""
        return f"layer.{layer}" not in self.held and not (backward and layer in self._resident)

    def _layer_params(self, layer: int, step: int, backward: bool, prefetch: bool = True) -> dict[str, torch.Tensor]:
        """The layer's tensors (held, kept from the forward, or fetched), and the next layer's copy
        started (prefetch=False: the caller starts it with _prefetch_ahead)."""
        unit, strip = self.units[f"layer.{layer}"], f"model.layers.{layer}."
        if unit.name in self.held:
            p = self.held[unit.name].tensors(strip)
        else:
            if backward and layer in self._resident:
                flat = self._resident.pop(layer)
            else:
                flat = self.delivery.fetch(unit, step)
                if not backward and self._is_resident(layer):
                    self._resident[layer] = flat
            p = unit_tensors(flat, unit, strip=strip)
        if prefetch:
            self._prefetch_next(layer, step, backward)
        return self.math.prepare(layer, p)

    def _prefetch_next(self, layer: int, step: int, backward: bool) -> None:
        nxt = layer - 1 if backward else layer + 1
        if 0 <= nxt < self.cfg.num_layers and self._fetched(nxt, backward):
            self.delivery.prefetch(self.units[f"layer.{nxt}"], step)

    def _prefetch_ahead(self, layer: int, step: int, backward: bool) -> None:
        """Start the copies of the fetched layers up to `prefetch_depth` ahead in this pass (those
        already started are not copied again). Called once the layer's compute is queued: a copy
        may wait for the host's update of its layer, and the GPU works meanwhile. Deeper copies
        absorb a late one; on the sharded route, a rank that reaches a gather late.

        Forward: at most `prefetch_depth` layers ahead by position, so every held layer's compute
        is queued before the wait for the first fetched layer after them (the host updates it
        last: held layers are there to hide that wait). Backward: the next `prefetch_depth`
        fetched layers, over held and kept ones (their versions are in: nothing blocks)."""
        if not backward:
            for nxt in range(layer + 1, min(layer + self.plan.prefetch_depth, self.cfg.num_layers - 1) + 1):
                if self._fetched(nxt, backward):
                    self.delivery.prefetch(self.units[f"layer.{nxt}"], step)
            return
        nxt, started = layer - 1, 0
        while nxt >= 0 and started < self.plan.prefetch_depth:
            if self._fetched(nxt, backward):
                self.delivery.prefetch(self.units[f"layer.{nxt}"], step)
                started += 1
            nxt -= 1

    def _weight(self, name: str, step: int) -> torch.Tensor:
        """The full embedding or head matrix in the compute dtype: held on the device, or fetched."""
        unit = self.units[name]
        tensor = "model.embed_tokens.weight" if name == "embed" else self.cfg.head_name
        if name in self.held:
            return self.held[name].tensors()[tensor]
        return unit_tensors(self.delivery.fetch(unit, step), unit)[tensor]

    def host_embedding(self, ids: torch.Tensor, version: int, ids_dev: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The rows of ids [M, m, T] (CPU; ids_dev: the same on the device) gathered from the store's copy
        of the embedding (as delivered: fp32 master or bf16 shadow) at `version`, on the device in the
        compute dtype, one per micro-batch (on CUDA the GPU reads the rows in place: host_rows.py)."""
        unit = self.units["embed"]
        self.link.wait_ready(unit, version)
        if self._host_rows is None:
            table = unit_tensors(self.source[unit.offset:], unit)["model.embed_tokens.weight"]
            self._host_rows = HostRows(table, self.device, self.dtype)
        table = self._host_rows.table
        self.delivery.h2d_bytes += ids.numel() * table.shape[1] * table.element_size()
        return [self._host_rows.rows(ids[i], None if ids_dev is None else ids_dev[i]) for i in range(ids.shape[0])]

    def _send(self, chunk: Chunk, grad: torch.Tensor, step: int) -> None:
        # the announcer tells the aggregator of each gradient that lands (their credits are the free slots);
        # a wait for a slot stops if it failed
        self.grads.send(chunk, grad, self.link.acquire_slot(self.grads.check), step)


    # ---- the step --------------------------------------------------------------------------
    def micro_attention(self, M: int, m: int, T: int, positions: torch.Tensor | None = None,
                        segments: torch.Tensor | None = None, real: torch.Tensor | None = None) -> list:
        """Each micro-batch's attention (attention.py) as the model's math takes it (its batch context), built
        once for every layer's forward, recompute and backward: plain causal rows, or rows of packed documents
        (positions, segments [M, m, T] on the CPU: each token's position in its document and the document's
        number in its row), through the variable-length kernel on CUDA and the dense mask elsewhere. real
        [M, m, T] bool: the tokens that are not padding (None: all)."""
        rope, cfg = self.math.rope(T), self.cfg
        windowed = any(w is not None and w < T for w in map(cfg.window_of, range(cfg.num_layers)))
        out = []
        for i in range(M):
            packed = positions is not None and segments is not None and not single_document(segments[i])
            backend = choose_backend(self.device, self.dtype, cfg.head_dim, packed, windowed)
            attn = packed_rows(rope, positions[i], segments[i], backend) if packed else plain_rows(rope, m, T, backend)
            out.append(self.math.batch_context(attn, positions[i] if packed else None,
                                               segments[i] if packed else None, None if real is None else real[i]))
        return out

    def run_step(self, step: int, ids: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None,
                 segments: torch.Tensor | None = None, scale: float | None = None,
                 real: torch.Tensor | None = None) -> StepTimes:
        """ids, targets: [M, m, T] int64 on the CPU (M local micro-batches of m sequences); targets equal to
        IGNORE_INDEX are not trained. positions, segments [M, m, T]: rows of packed documents (None: plain
        causal rows). scale: the step's loss scale, 1 / the global batch's trained targets (None: the
        engine's 1 / (global batch x seq_len), every target trained). real [M, m, T] bool: the tokens that
        are not padding, which the routers' auxiliary loss counts (None: all)."""
        times = StepTimes(tokens=int((targets != IGNORE_INDEX).sum()))
        t0 = time.perf_counter()
        cfg, H, tile = self.cfg, self.cfg.hidden_size, self.plan.seq_tile_tokens
        M, m, T = ids.shape
        attns = self.micro_attention(M, m, T, positions, segments, real)
        scale = self.scale if scale is None else scale
        routing = self.math.routing
        if routing is not None:
            routing.begin()
        ids_dev = ids.to(self.device)
        targets_dev = targets.to(self.device)
        tied = cfg.tie_word_embeddings
        embed_held = "embed" in self.held

        # ---- forward ------------------------------------------------------------------------
        with torch.no_grad():
            if tied or embed_held or not self.rows_from_host:  # the matrix on the device (held, or fetched whole)
                embed_w = self._weight("embed", step)
                xs = [self.math.embed(embed_w, ids_dev[i]) for i in range(M)]
            else:  # gather only the batch's rows from the host copy
                xs = [self.math.scale_embedding(x) for x in self.host_embedding(ids, step, ids_dev)]
            if self._fetched(0, backward=False):
                self.delivery.prefetch(self.units["layer.0"], step)
            self.saved.start(step, (M, m, T, H), self.dtype)
            for layer in range(cfg.num_layers):
                # a fetched layer starts the next one's copy before its compute is queued (so the
                # two overlap), a held layer after (that copy may wait for the host's update of it)
                held = f"layer.{layer}" in self.held
                p = self._layer_params(layer, step, backward=False, prefetch=not held)
                for i, x in enumerate(xs):
                    self.saved.save(layer, i, x)
                with self._span(f"forward layer {layer}", step, layer=layer):
                    xs = [self.math.layer_forward(layer, p, x, a, tile) for x, a in zip(xs, attns)]
                self._prefetch_ahead(layer, step, backward=False)
                del p
            self.delivery.prefetch(self.units["norm"], step)
            if not tied and "head" not in self.held:
                self.delivery.prefetch(self.units["head"], step)

        # ---- loss and its backward -------------------------------------------------------------
        norm_unit, head_unit = self.units["norm"], self.units["head"]
        norm_p = unit_tensors(self.delivery.fetch(norm_unit, step), norm_unit, strip="model.norm.")
        head_w = embed_w if tied else self._weight("head", step)
        last = cfg.num_layers - 1
        if self._fetched(last, backward=True):
            self.delivery.prefetch(self.units[f"layer.{last}"], step)
        self.saved.prefetch(last)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        norm_grad = torch.zeros(norm_unit.numel, dtype=torch.float32, device=self.device)
        norm_acc = unit_tensors(norm_grad, norm_unit, strip="model.norm.")
        head_grad = torch.zeros(head_unit.numel, dtype=torch.float32, device=self.device)
        head_grad_2d = head_grad[:cfg.vocab_size * H].view(cfg.vocab_size, H)
        with self._span("loss + head backward", step):
            for i, x in enumerate(xs):  # each x becomes its own gradient, in place
                loss_sum += self.math.loss_and_backward(x, targets_dev[i], norm_p, head_w, scale, tile,
                                                        self.plan.loss_chunk_tokens, norm_acc, head_grad_2d)
        grads_out = xs
        del xs, head_w, norm_p, norm_acc
        times.forward_s = time.perf_counter() - t0
        loss_value = float(loss_sum)
        times.loss_sum = loss_value
        finite = bool(torch.isfinite(loss_sum))
        if routing is None:
            skip = self.link.agree_loss(step, loss_value, times.tokens, finite)
        else:
            skip = self.link.agree_loss(step, loss_value, times.tokens, finite, routing.share())
            if not skip:
                routing.set_totals(self.link.routing_total(step))
        if skip:
            if routing is not None:
                routing.end()
            times.skipped = True
            self._resident.clear()
            self.saved.clear()
            self.delivery.discard(step)  # the backward's first copy, started before the loss
            return times
        t1 = time.perf_counter()
        self._send(norm_unit.chunks[0], norm_grad, step)
        held_grads: dict[str, torch.Tensor] = {}
        if not tied:
            if "head" in self.held:
                held_grads["head"] = head_grad
            else:
                self._send_rows(head_unit, head_grad, step)
                del head_grad, head_grad_2d

        # ---- backward, layer by layer in reverse -------------------------------------------------
        for layer in reversed(range(cfg.num_layers)):
            unit = self.units[f"layer.{layer}"]
            p = self._layer_params(layer, step, backward=True)
            if layer > 0:
                self.saved.prefetch(layer - 1)  # one layer ahead of the compute that needs it
            # the whole layer's gradient (the backward computes it at once); it leaves chunk by chunk
            acc = torch.zeros(unit.numel, dtype=torch.float32, device=self.device)
            acc_views = self.math.prepare(layer, unit_tensors(acc, unit, strip=f"model.layers.{layer}."))
            faults.hold("backward", step, layer=layer)  # the stall tests: a rank stuck in compute, outside collectives
            with self._span(f"backward layer {layer}", step, layer=layer):
                for i in range(M):
                    grads_out[i] = self.math.layer_backward(layer, p, self.saved.get(layer, i), attns[i], grads_out[i],
                                                            tile, acc_views)
            self._prefetch_ahead(layer, step, backward=True)
            self.saved.release(layer)
            del p, acc_views
            if f"layer.{layer}" in self.held:  # reduced, reported and updated on the device after backward
                held_grads[f"layer.{layer}"] = acc
            else:  # a layer cut into chunks: the updaters start on the first while the later ones copy out
                self._send_rows(unit, acc, step)
            del acc

        # ---- embedding: scatter the input gradients into rows (tied: onto the head's gradient) ----
        embed_unit = self.units["embed"]
        embed_grad = head_grad if tied else torch.zeros(embed_unit.numel, dtype=torch.float32, device=self.device)
        embed_grad_2d = embed_grad[:cfg.vocab_size * H].view(cfg.vocab_size, H)
        for i in range(M):
            embed_grad_2d.index_add_(0, ids_dev[i].reshape(-1), self.math.embedding_grad(grads_out[i], ids_dev[i]))
        del grads_out
        if embed_held:
            held_grads["embed"] = embed_grad
        else:
            self._send_rows(embed_unit, embed_grad, step)
        del embed_grad, embed_grad_2d
        if routing is not None:
            routing.end()
        self._report_held(held_grads, step)
        self.link.norms_reported(step)
        self._update_held(held_grads, step)
        times.backward_s = time.perf_counter() - t1
        return times

    def _report_held(self, grads: dict[str, torch.Tensor], step: int) -> None:
        """Reduce the device-held units' gradients among ranks and report their norms; then every host
        gradient's has been reported too."""
        # every host gradient announced first: on several hosts the rank's norm is the sum of what it announced
        self.grads.wait_announced()
        for name, g in grads.items():
            sq = self.held[name].reduce(g)  # of the summed gradient: every rank has it; rank 0 reports it
            first = self.units[name].chunks[0]
            for c in self.units[name].chunks:  # one chunk carries the unit's norm, the others 0
                self.link.device_grad(c, sq if c is first and self.held[name].rank == 0 else 0.0, step)

    def _update_held(self, grads: dict[str, torch.Tensor], step: int) -> None:
        """Update the device-held units on the device (with clipping, once the global norm is known)."""
        if not grads:
            return
        coef = None
        if self.max_grad_norm > 0:  # every host gradient is out (above): the global norm can be known
            verdict = Verdict.of(self.link.wait_norm(step), self.max_grad_norm)
            if verdict.skip:  # a non-finite gradient: the step is skipped everywhere, these units too
                return
            coef = verdict.coef
        with self._span("device AdamW (held units)", step):
            for name, g in grads.items():
                self.held[name].update(g, step, coef)

    def _send_rows(self, unit: Unit, full_grad: torch.Tensor, step: int) -> None:
        """Send a unit's flat gradient chunk by chunk (one contiguous range each: the embedding's or the
        head's row blocks, a layer's chunks), each announced as it lands."""
        for c in unit.chunks:
            start = c.offset - unit.offset
            self._send(c, full_grad[start:start + c.numel], step)
