"""The batch's rows of an embedding that lives on the host (the plan's `embedding = "host"`).

The forward needs only the rows of the batch's tokens. On CUDA the GPU gathers them itself: the
store's segments are page-locked and mapped into the device's address space (hostmem.py), so a
device tensor can alias the table, and the gather kernel reads just those rows over PCIe on the
compute stream, cast to the compute dtype piece by piece. Gathered on the CPU instead (the worker's
two threads, beside the updaters' AdamW) and copied from pageable memory, the rows of one 8 x 2,048
micro-batch of Qwen3-8B took ~0.2 s, with the GPU idle (docs/tuning.md, in git history). Where no mapping can be
made (a CPU worker; a driver that gives no device pointer) the rows are gathered on the CPU.
"""

from __future__ import annotations

import ctypes
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

GATHER_PIECE_BYTES = 32 << 20  # fp32 rows gathered per piece before their cast: the piece's device buffer
# A GPU rank's CPU threads (worker/shell.py): it launches kernels and, without a mapping, gathers the
# rows; few, so that the updaters keep the host's cores
RANK_THREADS = 2


class _Mapped:
    """A range of device-addressable memory as the CUDA array interface describes it (bytes)."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (pointer, False),
                                         "version": 3, "strides": None}


def _device_pointer(host_pointer: int) -> int | None:
    """The device's address of registered, mapped host memory (the driver's cuMemHostGetDevicePointer),
    or None where the driver gives none."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        get = driver.cuMemHostGetDevicePointer_v2
    except (OSError, AttributeError):
        return None
    pointer = ctypes.c_uint64()
    if get(ctypes.byref(pointer), ctypes.c_void_p(host_pointer), ctypes.c_uint(0)) != 0:
        return None
    return pointer.value


def device_of(device: torch.device) -> torch.device:
    """`device` with its index: "cuda" is the current CUDA device (a tensor's device always has one)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def mapped_view(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A tensor on `device` aliasing the registered host tensor `host` (contiguous), or None where the
    memory is not mapped for the device. Reading it reads host memory over PCIe; nothing is copied."""
    if device.type != "cuda" or not host.is_contiguous() or host.numel() == 0:
        return None
    device = device_of(device)
    pointer = _device_pointer(host.data_ptr())
    if pointer is None:
        return None
    nbytes = host.numel() * host.element_size()
    # the store is registered in pieces (hostmem.py): one alias needs the whole range mapped as one
    if _device_pointer(host.data_ptr() + nbytes - 1) != pointer + nbytes - 1:
        return None
    try:
        raw = torch.as_tensor(_Mapped(pointer, nbytes), device=device)
    except (RuntimeError, TypeError, ValueError):
        return None
    if raw.data_ptr() != pointer or raw.device != device:  # torch made a copy: not an alias
        return None
    return raw.view(host.dtype).view(host.shape)


class HostRows:
    """rows(ids) -> the embedding rows of ids on the device, in the compute dtype.

    table: the store's embedding matrix [vocab, hidden] (a view of the fp32 master or the bf16 shadow,
    whichever the plan delivers)."""

    def __init__(self, table: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
        device = device_of(device)
        self.table, self.device, self.dtype = table, device, dtype
        self.mapped = mapped_view(table, device)
        if self.mapped is not None and not self._reads_the_table():
            log.warning("the embedding's rows read through the device's mapping of the store differ from the "
                        "store's; gathering them on the CPU instead")
            self.mapped = None
        if device.type == "cuda" and self.mapped is None:
            log.warning("the embedding's rows are gathered on the CPU: the driver maps no device range for %s over "
                        "the whole table in the store; each micro-batch's rows cost CPU time", device)

    def _reads_the_table(self) -> bool:
        """Whether rows read through the mapping are the table's (first, middle and last), bit for bit."""
        probe = torch.tensor([0, self.table.shape[0] // 2, self.table.shape[0] - 1])
        got = self.mapped.index_select(0, probe.to(self.device)).cpu()
        return torch.equal(got.view(torch.uint8), self.table.index_select(0, probe).view(torch.uint8))

    @property
    def on_device(self) -> bool:
        return self.mapped is not None

    def rows(self, ids: torch.Tensor, ids_dev: torch.Tensor | None = None) -> torch.Tensor:
        """ids: [..] int64 on the CPU; ids_dev: the same on the device (saves a copy where the caller has it)."""
        if self.mapped is None:
            return F.embedding(ids, self.table).to(self.device, self.dtype)
        flat = (ids_dev if ids_dev is not None else ids.to(self.device)).reshape(-1)
        hidden = self.table.shape[1]
        out = torch.empty(flat.numel(), hidden, dtype=self.dtype, device=self.device)
        if self.mapped.dtype == self.dtype:  # the bf16 shadow: gathered straight into place
            torch.index_select(self.mapped, 0, flat, out=out)
        else:
            piece = max(1, GATHER_PIECE_BYTES // (hidden * self.mapped.element_size()))
            for a in range(0, flat.numel(), piece):
                out[a:a + piece].copy_(self.mapped.index_select(0, flat[a:a + piece]))
        return out.view(*ids.shape, hidden)
