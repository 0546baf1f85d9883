"""Page-locking the store's shared memory for the GPU: cudaHostRegister once per worker.

Registered memory is what makes copies from the store zero-copy DMA at full PCIe speed
(no pageable bounce, no staging copy). It is also mapped into the device's address space, so a
kernel can read it in place (host_rows.py: the batch's embedding rows). Registration is done in pieces of at most 64 GiB,
every return code checked, and undone before the memory is unmapped.
"""

from __future__ import annotations

import torch

_PIECE = 64 << 30
_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every context of the process
_REGISTER_MAPPED = 2  # cudaHostRegisterMapped: device-addressable (cudaHostGetDevicePointer)


class HostRegisterError(RuntimeError):
    pass


class Registration:
    def __init__(self) -> None:
        self.pieces: list[int] = []

    def register(self, tensor: torch.Tensor, what: str) -> None:
        if not torch.cuda.is_available() or tensor.numel() == 0:
            return
        cudart = torch.cuda.cudart()
        ptr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        for start in range(0, size, _PIECE):
            n = min(_PIECE, size - start)
            err = cudart.cudaHostRegister(ptr + start, n, _REGISTER_PORTABLE | _REGISTER_MAPPED)
            code = int(err.value) if hasattr(err, "value") else int(err)
            if code != 0:
                raise HostRegisterError(
                    f"cudaHostRegister of {what} ({n / 2**30:.2f} GiB at offset {start}) failed with CUDA error {code}; "
                    f"raise the locked-memory limit (`ulimit -l unlimited`, LimitMEMLOCK=infinity)"
                )
            self.pieces.append(ptr + start)

    def unregister(self) -> None:
        if not self.pieces:
            return
        torch.cuda.synchronize()
        cudart = torch.cuda.cudart()
        for ptr in self.pieces:
            cudart.cudaHostUnregister(ptr)
        self.pieces.clear()
