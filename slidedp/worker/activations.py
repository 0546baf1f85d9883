"""Each layer's input activations, from the forward that makes them to the backward that recomputes the layer.

The first `offload_layers` layers' inputs go to host memory: on CUDA, the forward copies each
input out on a D2H stream as soon as it exists (overlapping the layer that reads it), and the
backward copies a layer's inputs back on an H2D stream one layer ahead of the compute that
needs them (into buffers from the compute stream's cache: copy_buffers.py); one event per copy
direction and layer orders the streams. The host buffer is
allocated once, page-locked with cudaHostRegister (not pin_memory=True: PyTorch's pinned
allocator rounds every size up to a power of two, up to twice the host memory for a buffer
this large) and reused every step. The other layers' inputs stay on the device. On CPU the
same calls make plain copies, so the bookkeeping is the same everywhere.
"""

from __future__ import annotations

import math
import time
import weakref

import torch

from .copy_buffers import drop_unread, empty_for_copy
from ..store.hostmem import Registration
from ..tracing import NULL


class SavedInputs:
    """save(layer, i, x) in forward; prefetch(layer), get(layer, i), release(layer) in backward."""

    def __init__(self, device: torch.device, offload_layers: int) -> None:
        self.device = device
        self.offload_layers = offload_layers
        self.cuda = device.type == "cuda"
        self.tracer = NULL
        self.step = -1
        self._host: torch.Tensor | None = None  # [offload_layers, M, m, T, H]
        self._unpin: weakref.finalize | None = None
        self._kept: dict[int, list[torch.Tensor]] = {}
        self._out: dict[int, torch.cuda.Event] = {}  # layer -> recorded after its latest copy-out
        self._back: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}  # layer -> [M, m, T, H] on the device
        if self.cuda and offload_layers:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)

    def start(self, step: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """A new step whose inputs are M micro-batches of [m, T, H]: shape = (M, m, T, H)."""
        self.clear()
        self.step = step
        want = (self.offload_layers, *shape)
        if self.offload_layers and (self._host is None or self._host.shape != want or self._host.dtype != dtype):
            if self._unpin is not None:  # a new shape: unpin and drop the old buffer first
                self._unpin()
            self._host = None
            self._host = self._allocate(want, dtype)

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        what = (f"the activation offload buffer of {self.offload_layers} layer(s) ({' x '.join(map(str, shape))} "
                f"{dtype}, {math.prod(shape) * dtype.itemsize / 2**30:.1f} GiB)")
        try:
            host = torch.empty(shape, dtype=dtype)
        except RuntimeError as e:
            raise RuntimeError(f"could not allocate {what}: lower --offload-layers or free host memory") from e
        if self.cuda:
            pin = Registration()
            try:
                pin.register(host, what)  # raises naming the locked-memory limit to raise
            except RuntimeError:
                pin.unregister()  # the pieces that did register
                raise
            # unregister before the memory can go back to the allocator (the finalizer holds `host`)
            self._unpin = weakref.finalize(self, _unregister, pin, host)
            self._unpin.atexit = False  # at exit the process's memory goes anyway
        return host

    def save(self, layer: int, i: int, x: torch.Tensor) -> None:
        """Keep micro-batch i's input of `layer` for backward. x must not change afterwards."""
        if layer >= self.offload_layers:
            self._kept.setdefault(layer, []).append(x)
            return
        dst = self._host[layer, i]  # type: ignore[index]
        t0 = time.time()
        if not self.cuda:
            dst.copy_(x)
            self.tracer.event(f"offload layer {layer}", "d2h act", self.step, t0, time.time(), bytes=dst.nbytes)
            return
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h), torch.autograd.profiler.record_function(f"d2h:act{layer}.{i}"):
            self.d2h.wait_event(ready)
            with self.tracer.device_span(f"offload layer {layer}", "d2h act", self.step, self.d2h, bytes=dst.nbytes):
                dst.copy_(x, non_blocking=True)
            if layer not in self._out:
                self._out[layer] = torch.cuda.Event()
            done = self._out[layer]
            done.record(self.d2h)
        x.record_stream(self.d2h)  # its memory is not reused before the copy has read it

    def prefetch(self, layer: int) -> None:
        """Start bringing an offloaded layer's inputs back (no-op for kept layers or one already coming)."""
        if layer >= self.offload_layers or layer in self._back:
            return
        src = self._host[layer]  # type: ignore[index]
        t0 = time.time()
        if not self.cuda:
            self._back[layer] = (src.clone(), None)
            self.tracer.event(f"reload layer {layer}", "h2d act", self.step, t0, time.time(), bytes=src.nbytes)
            return
        out = empty_for_copy(src.shape, src.dtype, self.device, self.h2d)
        with torch.cuda.stream(self.h2d), torch.autograd.profiler.record_function(f"h2d:act{layer}"):
            self.h2d.wait_event(self._out[layer])  # the copy-out has landed
            with self.tracer.device_span(f"reload layer {layer}", "h2d act", self.step, self.h2d, bytes=src.nbytes):
                out.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.h2d)
        self._back[layer] = (out, event)

    def get(self, layer: int, i: int) -> torch.Tensor:
        """Micro-batch i's input of `layer` on the device, ready for the compute stream."""
        if layer >= self.offload_layers:
            return self._kept[layer][i]
        self.prefetch(layer)
        out, event = self._back[layer]
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)  # allocated on the compute stream (copy_buffers.py): waiting is all it needs
            self._back[layer] = (out, None)
        return out[i]

    def release(self, layer: int) -> None:
        """Backward is done with `layer`: free its device copies."""
        self._kept.pop(layer, None)
        self._drop(layer)

    def clear(self) -> None:
        self._kept.clear()
        for layer in list(self._back):
            self._drop(layer)

    def _drop(self, layer: int) -> None:
        if layer in self._back:
            _, event = self._back.pop(layer)
            drop_unread(event, self.device)  # a reload no get() waited for (a skipped step)


def _unregister(pin: Registration, host: torch.Tensor) -> None:
    pin.unregister()
