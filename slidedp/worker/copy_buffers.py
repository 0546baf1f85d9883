"""Device buffers that a copy stream fills and the compute stream reads and frees.

PyTorch's caching allocator keeps each stream's freed blocks for that stream alone. Buffers
allocated on a copy stream and freed after the compute stream used them go back to the copy
stream's cache, where the compute stream cannot take them: under `memory.device_budget_gib`
the two caches together meet the cap, and each time the allocator releases every cached block,
which synchronizes the device (no copy overlaps compute across it). Allocated on the compute
stream instead, the parameters and reloaded activations share one cache with the layers' own
memory. The copy stream then waits until the compute stream has reached the allocation, so it
never writes memory the compute stream's earlier work still reads.
"""

from __future__ import annotations

import torch


def empty_for_copy(shape: int | tuple[int, ...], dtype: torch.dtype, device: torch.device,
                   copy_stream: torch.cuda.Stream) -> torch.Tensor:
    """A device buffer from the current (compute) stream's cache, safe for `copy_stream` to fill.
    Call it outside `torch.cuda.stream(copy_stream)`."""
    compute = torch.cuda.current_stream(device)
    if compute == copy_stream:
        raise RuntimeError("empty_for_copy is called on the compute stream, not inside the copy stream's context")
    out = torch.empty(shape, dtype=dtype, device=device)
    allocated = torch.cuda.Event()
    allocated.record(compute)
    copy_stream.wait_event(allocated)
    return out


def drop_unread(filled: torch.cuda.Event | None, device: torch.device) -> None:
    """Before a buffer that the compute stream never waited for is dropped: its memory goes back to
    the compute stream's cache, so that stream must not reuse it before the copy into it has ended."""
    if filled is not None:
        torch.cuda.current_stream(device).wait_event(filled)
