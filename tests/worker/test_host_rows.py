"""The batch's embedding rows from the store's host copy: the same bits whichever side gathers them.

On a real store in shared memory. The GPU tests register the store's master as a worker does and check
that the device reads the rows in place (a write to the host table shows in the next gather) with the
bits the CPU gather and the cast make; the CPU tests run the piecewise gather itself on a CPU tensor.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slidedp.model.config import named_shape
from slidedp.store.layout import make_layout
from slidedp.store.store import HostStore, fill_random
from slidedp.store import host_rows
from slidedp.store.host_rows import HostRows, mapped_view
from slidedp.store.hostmem import Registration
from slidedp.store.layout import unit_tensors, units_of

from pipeline.harness import unique_store


@pytest.fixture
def store():
    s = HostStore.create(unique_store("hr"), make_layout(named_shape("tiny", 512)), {"source": "random"},
                         shadow=True, fill=fill_random(0))
    yield s
    s.destroy()


def _table(store: HostStore, segment: str) -> torch.Tensor:
    unit = units_of(store.layout)["embed"]
    return unit_tensors(store.flat(segment)[unit.offset:], unit)["model.embed_tokens.weight"]


def _ids(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (3, 37), generator=g)  # 111 tokens: pieces of 8 leave a partial one


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def test_a_cpu_worker_gathers_the_rows_it_would_look_up(store):
    table = _table(store, "master")
    ids = _ids(table.shape[0])
    rows = HostRows(table, torch.device("cpu"), torch.bfloat16)
    assert not rows.on_device and mapped_view(table, torch.device("cpu")) is None
    got = rows.rows(ids)
    assert got.shape == (3, 37, table.shape[1]) and got.dtype == torch.bfloat16
    assert torch.equal(_bits(got), _bits(F.embedding(ids, table).to(torch.bfloat16)))


@pytest.mark.parametrize("segment, dtype", [("master", torch.bfloat16), ("shadow", torch.bfloat16), ("master", torch.float32)])
def test_the_piecewise_gather_and_cast_make_the_bits_of_one_lookup(store, monkeypatch, segment, dtype):
    """The device path's loop, run on a CPU tensor standing in for the mapped table."""
    if segment == "shadow" and dtype != torch.bfloat16:
        pytest.skip("a shadow feeds a bf16 compute only")
    table = _table(store, segment)
    ids = _ids(table.shape[0])
    monkeypatch.setattr(host_rows, "GATHER_PIECE_BYTES", 8 * table.shape[1] * table.element_size())  # 8 rows
    rows = HostRows(table, torch.device("cpu"), dtype)
    rows.mapped = table
    got = rows.rows(ids, ids)
    assert torch.equal(_bits(got), _bits(F.embedding(ids, table).to(dtype)))


def test_a_mapping_that_reads_other_bits_is_not_used(store, monkeypatch, caplog):
    """Should a device pointer read other memory than the table's, the rows come from the CPU."""
    table = _table(store, "master")
    monkeypatch.setattr(host_rows, "mapped_view", lambda host, device: torch.zeros_like(host))
    with caplog.at_level("WARNING", logger="slidedp.store.host_rows"):
        rows = HostRows(table, torch.device("cpu"), torch.bfloat16)
    assert not rows.on_device
    assert "differ from the store's; gathering them on the CPU instead" in caplog.text
    ids = _ids(table.shape[0])
    assert torch.equal(_bits(rows.rows(ids)), _bits(F.embedding(ids, table).to(torch.bfloat16)))
    monkeypatch.setattr(host_rows, "mapped_view", lambda host, device: host)  # one that reads the table is used
    assert HostRows(table, torch.device("cpu"), torch.bfloat16).on_device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gpu_reads_the_rows_in_place_from_the_registered_store(store, monkeypatch):
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    reg = Registration()
    try:
        for segment in ("master", "shadow"):
            reg.register(store.flat(segment), segment)
        for segment in ("master", "shadow"):
            table = _table(store, segment)
            ids = _ids(table.shape[0])
            monkeypatch.setattr(host_rows, "GATHER_PIECE_BYTES", 8 * table.shape[1] * table.element_size())
            rows = HostRows(table, device, torch.bfloat16)
            assert rows.on_device, segment
            got = rows.rows(ids, ids.to(device))
            assert got.device == device
            assert torch.equal(_bits(got.cpu()), _bits(F.embedding(ids, table).to(torch.bfloat16))), segment
            # an alias, not a copy: a write to the host table is what the next gather reads
            token = int(ids[0, 0])
            table[token] = 2.5
            assert torch.all(rows.rows(ids[:1, :1], ids[:1, :1].to(device)).cpu().float() == 2.5), segment
        # memory the driver has not mapped: no view, and the rows are gathered on the CPU
        plain = torch.randn(64, 16)
        assert mapped_view(plain, device) is None
        fallback = HostRows(plain, device, torch.bfloat16)
        assert not fallback.on_device
        small = torch.tensor([[3, 1, 63]])
        assert torch.equal(_bits(fallback.rows(small).cpu()), _bits(F.embedding(small, plain).to(torch.bfloat16)))
    finally:
        torch.cuda.synchronize()
        reg.unregister()


def test_the_calibration_times_the_cpu_gather_on_a_ranks_threads_where_nothing_is_mapped(monkeypatch):
    """No device mapping (a CPU device here): the calibration's probe times the CPU's gather, on a GPU rank's
    RANK_THREADS threads, and gives the caller its thread count back."""
    from slidedp.planner.measure import embedding_rows_rate

    seen = []
    real_rows = HostRows.rows

    def rows(self, ids, ids_dev=None):
        seen.append((torch.get_num_threads(), self.on_device, ids.numel()))
        return real_rows(self, ids, ids_dev)

    monkeypatch.setattr(HostRows, "rows", rows)
    before = torch.get_num_threads()
    torch.set_num_threads(1 if before != 1 else 2)
    try:
        threads = torch.get_num_threads()
        where, rate = embedding_rows_rate("cpu", quick=True, repeat=2)
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    assert where == "cpu" and rate > 0
    assert seen == [(host_rows.RANK_THREADS, False, 2048)] * 3  # one warm-up, two timed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_calibration_times_the_gpu_reading_the_rows_in_place():
    from slidedp.planner.measure import embedding_rows_rate

    where, rate = embedding_rows_rate("cuda", quick=True, repeat=2)
    assert where == "device" and rate > 0  # the worker's mapping is what was timed, not the CPU's gather


def test_a_locked_memory_limit_below_the_probe_leaves_the_rows_unmeasured(monkeypatch, caplog):
    """cudaHostRegister would fail (and leave an error for the next kernel launch): the probe registers nothing,
    says which limit to raise, and the calibration records the rows as not measured."""
    from slidedp.planner import measure
    from slidedp.planner.calibrate import embedding_rows_fields

    monkeypatch.setattr(measure, "lockable_bytes", lambda: 64 << 10)
    monkeypatch.setattr(Registration, "register", lambda *a, **k: pytest.fail("registered past the limit"))
    with caplog.at_level("WARNING", logger="slidedp.planner"):
        assert measure.embedding_rows_rate("cuda") == ("", 0.0)
        assert embedding_rows_fields("cuda") == {"embedding_rows_gather": "", "embedding_rows_gbps": 0.0}
    assert "the locked-memory limit (65536 bytes) is below the probe's table; raise it (`ulimit -l unlimited`" in caplog.text
