"""Buffers a copy stream fills come from the compute stream's cache and are never written early (CUDA)."""

from __future__ import annotations

import pytest
import torch

from slidedp.worker.copy_buffers import drop_unread, empty_for_copy

pytestmark = pytest.mark.gpu
N = 8 << 20  # 32 MiB of fp32: a block of its own in the allocator


def _filled(copy: torch.cuda.Stream, host: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
    out = empty_for_copy(host.numel(), host.dtype, torch.device("cuda"), copy)
    with torch.cuda.stream(copy):
        out.copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(copy)
    return out, done


def test_the_compute_stream_reuses_what_the_copy_stream_filled():
    copy = torch.cuda.Stream()
    host = torch.arange(N, dtype=torch.float32).pin_memory()
    out, done = _filled(copy, host)
    torch.cuda.current_stream().wait_event(done)
    assert torch.equal(out.cpu(), host)
    ptr = out.data_ptr()
    del out
    mine = torch.empty(N, device="cuda")
    assert mine.data_ptr() == ptr  # one cache: the compute stream takes it back

    with torch.cuda.stream(copy):  # what it replaces: a buffer made on the copy stream stays in that stream's cache
        theirs = torch.empty(N, device="cuda")
    theirs_ptr = theirs.data_ptr()
    theirs.record_stream(torch.cuda.current_stream())
    del theirs
    torch.cuda.synchronize()
    assert torch.empty(N, device="cuda").data_ptr() != theirs_ptr
    del mine


def test_the_copy_waits_for_the_compute_streams_earlier_reads_of_that_memory():
    copy = torch.cuda.Stream()
    old = torch.full((N,), 7.0, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the compute stream is busy for a while (about 0.1 s) ...
    read = old.clone()  # ... before it reads `old`
    ptr = old.data_ptr()
    del old  # freed on the compute stream: the next allocation of its size takes the same block
    out, done = _filled(copy, torch.zeros(N).pin_memory())
    assert out.data_ptr() == ptr
    torch.cuda.current_stream().wait_event(done)
    torch.cuda.synchronize()
    assert torch.equal(read, torch.full((N,), 7.0, device="cuda"))  # the copy did not overwrite it first
    assert int(out.count_nonzero()) == 0


def test_a_dropped_buffer_is_not_reused_before_its_copy_has_ended():
    copy = torch.cuda.Stream()
    host = torch.ones(N).pin_memory()
    with torch.cuda.stream(copy):
        torch.cuda._sleep(200_000_000)  # the copy starts late
    out, done = _filled(copy, host)
    ptr = out.data_ptr()
    drop_unread(done, torch.device("cuda"))
    del out  # never read: a skipped step's copy
    again = torch.zeros(N, device="cuda")  # same block; the zeros come after the copy on the compute stream
    assert again.data_ptr() == ptr
    torch.cuda.synchronize()
    assert int(again.count_nonzero()) == 0


def test_it_refuses_to_allocate_inside_the_copy_streams_context():
    copy = torch.cuda.Stream()
    with torch.cuda.stream(copy), pytest.raises(RuntimeError, match="not inside the copy stream's context"):
        empty_for_copy(4, torch.float32, torch.device("cuda"), copy)
