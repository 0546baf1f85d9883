"""Device spans in a traced step: CUDA events read after the step, placed on the wall clock by an anchor."""

from __future__ import annotations

import json

import pytest
import torch

from slidedp.tracing import NULL, Tracer


class FakeEvent:
    """A recorded CUDA event that ran `before_ms` before the anchor."""

    def __init__(self, before_ms: float) -> None:
        self.before_ms = before_ms

    def elapsed_time(self, anchor: object) -> float:
        return self.before_ms


def lines(tmp_path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "trace" / "worker0.jsonl").read_text().splitlines()]


def test_device_spans_are_placed_before_the_anchor_by_their_elapsed_time(tmp_path):
    tracer = Tracer(tmp_path, "worker0", (3,))
    # as device_span leaves them: a copy that ran 4 ms, ending 10 ms before the anchor
    tracer._device.append(("h2d layer.1", "h2d", 3, FakeEvent(14.0), FakeEvent(10.0), {"bytes": 8}))
    tracer._device.append(("forward layer 0", "compute", 3, FakeEvent(15.5), FakeEvent(2.5), {}))
    tracer.flush_device(anchor=object(), now=1000.0)
    h2d, fwd = lines(tmp_path)
    assert (h2d["name"], h2d["tid"], h2d["args"]) == ("h2d layer.1", "h2d", {"bytes": 8, "step": 3})
    assert h2d["ts"] == pytest.approx((1000.0 - 0.014) * 1e6) and h2d["dur"] == pytest.approx(4000.0)
    assert fwd["ts"] == pytest.approx((1000.0 - 0.0155) * 1e6) and fwd["dur"] == pytest.approx(13000.0)
    assert fwd["ts"] < h2d["ts"] < h2d["ts"] + h2d["dur"] < fwd["ts"] + fwd["dur"]  # the copy overlapped the compute
    tracer.flush_device(anchor=object(), now=2000.0)  # read once: nothing written again
    assert len(lines(tmp_path)) == 2


def test_untraced_steps_record_no_events(tmp_path):
    tracer = Tracer(tmp_path, "worker0", (3,))
    with tracer.device_span("forward layer 0", "compute", 4):  # no CUDA needed: step 4 is not traced
        pass
    with NULL.device_span("forward layer 0", "compute", 3):
        pass
    assert tracer._device == [] and NULL._device == []
    tracer.flush_device()  # nothing pending: it does not touch CUDA
    assert not (tmp_path / "trace" / "worker0.jsonl").read_text()


@pytest.mark.gpu
def test_a_copy_on_its_stream_overlaps_the_compute_it_ran_beside(tmp_path):
    """On CUDA nothing waits: a copy queued on its own stream while a long kernel runs shows inside it."""
    tracer = Tracer(tmp_path, "worker0", (0,))
    dev = torch.device("cuda")
    a = torch.randn(8192, 8192, device=dev)
    host = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
    side = torch.cuda.Stream(dev)
    with tracer.device_span("compute", "compute", 0):
        for _ in range(20):
            a = a @ a / 8192
        with torch.cuda.stream(side), tracer.device_span("h2d", "h2d", 0, side):
            host.to(dev, non_blocking=True)
    tracer.flush_device(dev)
    spans = {e["name"]: e for e in lines(tmp_path)}
    compute, h2d = spans["compute"], spans["h2d"]
    assert compute["dur"] > 0 and h2d["dur"] > 0
    assert compute["ts"] <= h2d["ts"] and h2d["ts"] + h2d["dur"] <= compute["ts"] + compute["dur"]


def test_spans_left_at_close_are_dropped_without_touching_the_device(tmp_path, monkeypatch):
    """Spans still pending at close belong to a step that failed before its flush: reading them could wait
    on a device in error (or in a collective whose peer is gone), so close drops them and closes the file."""
    tracer = Tracer(tmp_path, "worker0", (3,))
    tracer.event("forward layer 0", "compute", 3, 1.0, 2.0)  # a host span of the step, written
    tracer._device.append(("forward layer 1", "compute", 3, FakeEvent(2.0), FakeEvent(1.0), {}))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("close waited for the device"))
    tracer.close()
    assert tracer._device == [] and tracer._file is None
    assert [e["name"] for e in lines(tmp_path)] == ["forward layer 0"]
