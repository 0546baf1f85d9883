"""Measuring this host's building blocks: `calibrate()`, and the host's rates measured again.

`calibrate()` measures what `Calibration` holds of the host: pinned H2D, D2H and both at once; the
fused CPU AdamW and an fp32 sum; a layer-sized matmul in the compute dtype and the fused AdamW on the
device; host memory (host_bandwidth.py); on CUDA, how a host-held embedding's rows reach the GPU
(measure.embedding_rows_rate). On `device="cpu"` it returns a CPU-only calibration (copies at memcpy
speed, "GPU" rates = the CPU's), so planning works in CI. `host_rates` measures the host's figures
again (cache.remeasure_host keeps the better of each). The GPU links (links.py) and the AdamW rate
beside copies (measure.adamw_beside_copies) are measured where the cache lacks them (cache.py).
"""

from __future__ import annotations

import dataclasses
import socket
from typing import Any, Callable

from slidedp.planner.calibration import Calibration, CalibrationError
from slidedp.planner.measure import fused_adamw, timed

# A decoder layer's matmul-FLOP rate over a bare matmul's, eager kernels (benchmarks.layer_bench and
# training runs; docs/planner.md, "The constants").
LAYER_EFFICIENCY = 0.45


def _median_time(fn: Callable[[], None], sync: Callable[[], None], reps: int) -> float:
    """Median seconds of fn after one warm-up run (allocation, first-touch, kernel selection)."""
    return timed(fn, sync, reps, warmup=1)


def _adamw_rate(n: int, device: str, sync: Callable[[], None], reps: int, state: tuple | None = None) -> float:
    """The fused AdamW's rate (params/s) over `n` fresh parameters, or over `state`'s (param, grad,
    exp_avg, exp_avg_sq) tensors where given (e.g. in shared memory, as the store's are)."""
    import torch

    if state is None:
        p, g = torch.rand(n, device=device), torch.rand(n, device=device)
        m, v = torch.zeros(n, device=device), torch.zeros(n, device=device)
    else:
        p, g, m, v = state
        n = p.numel()
    step = torch.ones((), device=device)
    return n / _median_time(lambda: fused_adamw([p], [g], [m], [v], [step]), sync, reps)


def device_label(device: str) -> str:
    """The device's name, as the cache files are named by: the GPU's model, or "cpu (ARCH)"."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return f"cpu ({platform.machine() or 'unknown'})"


def host_memory_fields(quick: bool = False) -> dict[str, Any]:
    """The host memory figures of a calibration, measured now (planner/host_bandwidth.py, about a second)."""
    from slidedp.planner.host_bandwidth import measure_host_memory

    hm = measure_host_memory(quick=quick)
    return {"host_read_gbps": hm.read_gbps, "host_write_gbps": hm.write_gbps, "host_copy_gbps": hm.copy_gbps,
            "host_node_copy_gbps": ",".join(f"{g:.1f}" for g in hm.node_copy_gbps)}


def calibrate(device: str = "cuda", quick: bool = False) -> Calibration:
    """Measure the building blocks on this host. quick: small sizes, a few seconds on a CPU."""
    return dataclasses.replace(_calibrate(device, quick), **host_memory_fields(quick))


def _cpu_rates(quick: bool) -> tuple[float, float]:
    """The CPU side: the updater's fused AdamW (params/s) and the aggregator's sum (GB/s of output)."""
    import torch

    reps = 3 if quick else 10
    cpu_sync = lambda: None  # noqa: E731
    adamw = _adamw_rate((4 if quick else 64) << 20, "cpu", cpu_sync, reps)
    n = (4 if quick else 32) << 20
    a, b, c = torch.rand(n), torch.rand(n), torch.empty(n)
    reduce_gbps = n * 4 / _median_time(lambda: torch.add(a, b, out=c), cpu_sync, reps) / 1e9
    return adamw, reduce_gbps


# The host's figures that a first plan of a shape measures again once its GPU blocks are measured
# (tens of seconds after the calibration): a fresh machine's first minute can measure them slow
# (the journal "A fresh machine's first minute" of docs/tuning.md, in git history). Something running beside a probe lowers a
# rate and nothing raises it, so each field keeps the better of its measurements.
HOST_RATE_FIELDS = ("adamw_params_per_s", "reduce_gbps", "host_read_gbps", "host_write_gbps", "host_copy_gbps",
                    "adamw_beside_copies_params_per_s", "h2d_gbps", "d2h_gbps", "bidir_gbps", "embedding_rows_gbps")


def host_rates(device: str, threads: int, gpus: int, quick: bool = False) -> dict[str, Any]:
    """HOST_RATE_FIELDS (and host_node_copy_gbps) measured now; PCIe and AdamW beside copies on CUDA only."""
    adamw, reduce_gbps = _cpu_rates(quick)
    rates: dict[str, Any] = {"adamw_params_per_s": adamw, "reduce_gbps": reduce_gbps, **host_memory_fields(quick)}
    if device.startswith("cuda"):
        from slidedp.planner.measure import adamw_beside_copies

        rates.update(_pcie_rates(device, quick))
        rates["adamw_beside_copies_params_per_s"] = adamw_beside_copies(threads, device, gpus)
        rates.update(embedding_rows_fields(device, quick))
    return rates


def embedding_rows_fields(device: str, quick: bool = False) -> dict[str, Any]:
    """How and how fast a host-held embedding's rows reach the GPU, measured now (measure.embedding_rows_rate)."""
    from slidedp.planner.measure import embedding_rows_rate

    where, rate = embedding_rows_rate(device, quick)  # ("", 0.0): not measured; the plan charges the copy-in rate
    return {"embedding_rows_gather": where, "embedding_rows_gbps": rate / 1e9}



def _pcie_rates(device: str, quick: bool) -> dict[str, float]:
    """Pinned host-to-device, device-to-host and both at once (the two directions' total), GB/s."""
    import torch

    reps = 3 if quick else 10
    dev = torch.device(device)
    sync = lambda: torch.cuda.synchronize(dev)  # noqa: E731
    nbytes = (256 if quick else 1024) << 20
    host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_in = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dev_out = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h2d = nbytes / _median_time(lambda: dev_in.copy_(host_in, non_blocking=True), sync, reps) / 1e9
    d2h = nbytes / _median_time(lambda: host_out.copy_(dev_out, non_blocking=True), sync, reps) / 1e9
    s_in, s_out = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def both() -> None:
        with torch.cuda.stream(s_in):
            dev_in.copy_(host_in, non_blocking=True)
        with torch.cuda.stream(s_out):
            host_out.copy_(dev_out, non_blocking=True)

    bidir = 2 * nbytes / _median_time(both, sync, reps) / 1e9
    host_in = host_out = dev_in = dev_out = None  # free them before the next measurement
    torch.cuda.empty_cache()
    return {"h2d_gbps": h2d, "d2h_gbps": d2h, "bidir_gbps": max(bidir, h2d, d2h)}


def _calibrate(device: str, quick: bool) -> Calibration:
    import psutil
    import torch

    reps = 3 if quick else 10
    cpu_sync = lambda: None  # noqa: E731
    adamw, reduce_gbps = _cpu_rates(quick)

    if device == "cpu":
        nbytes = (64 if quick else 512) << 20
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        src.fill_(1)
        copy = nbytes / _median_time(lambda: dst.copy_(src), cpu_sync, reps) / 1e9
        src = dst = None
        k = 512 if quick else 2048
        x, w = torch.rand(k, k), torch.rand(k, k)
        matmul = 2 * k**3 / _median_time(lambda: torch.mm(x, w), cpu_sync, reps) / 1e12
        return Calibration(
            host=socket.gethostname(), device_name=device_label("cpu"),
            h2d_gbps=copy, d2h_gbps=copy, bidir_gbps=copy,  # one memory system: copies share it
            adamw_params_per_s=adamw, adamw_threads=torch.get_num_threads(), reduce_gbps=reduce_gbps,
            device_tflops=matmul * LAYER_EFFICIENCY, device_mem_bytes=int(psutil.virtual_memory().total),
            device_adamw_params_per_s=adamw,
        )

    if not torch.cuda.is_available():
        raise CalibrationError(f"calibrate(device={device!r}) needs CUDA; use device='cpu' on a machine without a GPU")
    dev = torch.device(device)
    sync = lambda: torch.cuda.synchronize(dev)  # noqa: E731
    pcie = _pcie_rates(device, quick)
    # a layer-like matmul: [tokens, H] x [H, I] at a 7B-ish shape
    t, h, i = (4096, 4096, 11008) if quick else (8192, 4096, 14336)
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    w = torch.randn(h, i, device=dev, dtype=torch.bfloat16)
    matmul = 2 * t * h * i / _median_time(lambda: torch.mm(x, w), sync, reps) / 1e12
    x = w = None  # free them before the next measurement
    device_adamw = _adamw_rate((16 if quick else 64) << 20, device, sync, reps)
    torch.cuda.empty_cache()
    return Calibration(
        host=socket.gethostname(), device_name=device_label(device),
        **pcie, adamw_params_per_s=adamw, adamw_threads=torch.get_num_threads(), reduce_gbps=reduce_gbps,
        device_tflops=matmul * LAYER_EFFICIENCY,
        device_mem_bytes=int(torch.cuda.get_device_properties(dev).total_memory),
        device_adamw_params_per_s=device_adamw, **embedding_rows_fields(device, quick),
    )
