"""The manifest's per-chunk fields: where they lie in the segment, and that reading one costs no work
that grows with the layout (the updater reads several per chunk update)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from slidedp.model.config import named_shape
from slidedp.store import manifest as manifest_module
from slidedp.store.layout import make_layout
from slidedp.store.manifest import _FIXED, PAGE, Manifest
from slidedp.store.shm import segment_name

from . import cleanup_store, unique_store


@pytest.fixture
def qwen3_8b_manifest():
    """A manifest segment for Qwen3-8B's layout (45 chunks; the segment is its layout and four arrays)."""
    store = unique_store("mf")
    layout = make_layout(named_shape("qwen3-8b"))
    m = Manifest.create(segment_name(store, "manifest"), layout, {"source": "random", "seed": 0}, generation=3)
    try:
        yield m
    finally:
        m.close()
        cleanup_store(store)


def test_the_fields_lie_past_the_layout_the_header_measures(qwen3_8b_manifest):
    m = qwen3_8b_manifest
    n = len(m.layout.chunks)
    assert n == 45
    m.versions[:] = np.arange(n)
    m.updating[7] = 3
    m.adam_steps[44] = 12
    m.snapshot[0] = 1
    body_len = _FIXED.unpack_from(m.seg.mm, 0)[5]
    start = PAGE + (body_len + PAGE - 1) // PAGE * PAGE
    raw = m.seg.mm
    # the four int64 arrays, each n long, back to back, in the order versions, updating, adam steps, snapshot
    assert struct.unpack_from(f"<{n}q", raw, start) == tuple(range(n))
    assert struct.unpack_from("<q", raw, start + 8 * (n + 7))[0] == 3
    assert struct.unpack_from("<q", raw, start + 8 * (2 * n + 44))[0] == 12
    assert struct.unpack_from("<q", raw, start + 8 * 3 * n)[0] == 1
    # a second process's handle reads them where the first wrote them
    other = Manifest.open(m.seg.name)
    try:
        assert list(other.versions) == list(range(n))
        assert (other.updating[7], other.adam_steps[44], other.snapshot[0]) == (3, 12, 1)
    finally:
        other.close()


def test_reading_a_field_does_not_serialize_the_layout_again(qwen3_8b_manifest, monkeypatch):
    """Each field read serialized the whole layout to find where the arrays start: ~1.5 ms for Qwen3-8B,
    seven reads per chunk update, ~5 ms of each update in training (one H200, f59e212's trace)."""
    m = qwen3_8b_manifest
    other = Manifest.open(m.seg.name)

    def no_body(*_args, **_kwargs):
        raise AssertionError("a field read serialized the layout")

    monkeypatch.setattr(manifest_module, "_body", no_body)
    try:
        for handle in (m, other):
            for _ in range(3):
                handle.versions[5] += 1
                handle.updating[5] = 0
                handle.adam_steps[5] += 1
                assert handle.snapshot[5] == 0
        assert (m.versions[5], other.adam_steps[5]) == (6, 6)
    finally:
        other.close()
