"""Measured inputs of the step-time model, calibrated once per host and device and cached.

`calibrate()` measures the building blocks the schedule is made of: pinned H2D, D2H and both
at once; the fused CPU AdamW (`torch._fused_adamw_`, the kernel the updater runs); an fp32 sum
(the aggregator); a layer-sized matmul in the compute dtype, and the fused AdamW on the device
(for an embedding kept on the GPU); on CUDA, load_or_calibrate adds the fused CPU AdamW's rate while
pinned copies run beside it (measure.adamw_beside_copies). The GPU work of a step itself is measured
per shape at plan time (measure.py) and rides along as `Calibration.blocks`. On `device="cpu"` it
returns a CPU-only calibration (copies at memcpy speed, "GPU" rates = the CPU's), so planning works in CI.

The cache is JSON (never pickle), one file per host and device name, under ~/.cache/slidedp:
the measured building blocks, and what training runs measured (`record_training`) kept per
model, so that a host that trains several models keeps each one's figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import re
import socket
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from slidedp import log, old_names
from slidedp.hosttraffic import ADAMW_BYTES
from slidedp.planner.measure import MeasuredBlocks, timed

_log = log.get("planner")

SCHEMA = 1
# A decoder layer's matmul-FLOP rate over a bare matmul's, eager kernels (benchmarks.layer_bench and
# training runs; docs/tuning.md, "The planner's constants").
LAYER_EFFICIENCY = 0.45


class CalibrationError(ValueError):
    pass


# What a training run measures of a model, kept per model in the cache (keyed by parameter count):
# each group of fields names the model it was measured on. The updaters' rate; their rate beside a
# host sum of ranks' gradients and that sum's rate.
LEARNED_GROUPS: dict[str, tuple[str, ...]] = {
    "adamw_train_model_params": ("adamw_train_params_per_s",),
    "adamw_train_summed_model_params": ("adamw_train_summed_params_per_s", "reduce_train_summed_gbps"),
}
LEARNED_FIELDS = tuple(f for model, values in LEARNED_GROUPS.items() for f in (*values, model))
_NOTHING_LEARNED: dict[str, Any] = {k: 0 for k in LEARNED_FIELDS}
# Fields of older cache files that nothing reads now: runs' GPU-time factors per model and shape of
# GPU work, replaced by the GPU blocks measured at plan time (measure.py). Dropped on reading, with a note.
RETIRED_FIELDS = ("gpu_train_factors", "gpu_train_model_params")
# The step model's shares of the bare AdamW rate: constants of this checkout, not measurements of the
# host. A cache does not keep them (one written with them charges this checkout's, not its own).
MODEL_SHARES = ("adamw_train_fraction", "adamw_train_fraction_low")

# 0 = not measured yet: what training runs measure, the host's copy-in with every GPU at once, the
# AdamW rate beside the copies (measured on CUDA only), and host memory (a cache file from before it)
_MAY_BE_ZERO = frozenset(LEARNED_FIELDS) | {"h2d_total_gbps", "adamw_beside_copies_params_per_s",
                                            "adamw_beside_copies_gpus", "host_read_gbps", "host_write_gbps",
                                            "host_copy_gbps", "embedding_rows_gbps"}


@dataclass(frozen=True)
class Calibration:
    host: str
    device_name: str
    h2d_gbps: float  # pinned host->device, GB/s (1e9 B/s), per rank
    d2h_gbps: float  # pinned device->host
    bidir_gbps: float  # both directions at once, total of the two
    adamw_params_per_s: float  # fused CPU AdamW, one updater process using `adamw_threads` threads
    adamw_threads: int
    reduce_gbps: float  # aggregator fp32 sum of 2 buffers, GB/s of output
    device_tflops: float  # effective TFLOP/s of a decoder layer's matmul FLOPs in the compute dtype
    device_mem_bytes: int  # the device's memory: no budget may exceed it
    device_adamw_params_per_s: float = 1.0e11  # fused AdamW on the device (embedding kept on the GPU)
    # GPU-to-GPU collective bus bandwidth (NCCL all-gather, as nccl-tests reports it), measured
    # among `bus_gpus` GPUs; with bus_gpus = 1 it was not measured (a conservative NVLink figure,
    # used only for an embedding kept on the GPU) and the planner offers no sharded route.
    allreduce_gbps: float = 100.0
    bus_gpus: int = 1
    # all `bus_gpus` GPUs copying from host memory at once, GB/s in total: what N replicated
    # ranks share (0: not measured; each rank then gets its own h2d_gbps)
    h2d_total_gbps: float = 0.0
    # the updaters' AdamW rate measured during a training run on this host, per process, and the
    # parameter count of the model it trained (lower than the bare kernel's: DMA, the aggregator and
    # the workers compete for the host). The planner charges it for that model only. 0: no run yet.
    adamw_train_params_per_s: float = 0.0
    adamw_train_model_params: int = 0
    # the same, and the aggregator's sum rate (as reduce_gbps), measured in a run whose aggregator
    # summed several ranks' whole gradients beside the updaters (grad_route = "host"; both compete for
    # host memory). Charged to plans of that model on that route only. 0: no such run yet.
    adamw_train_summed_params_per_s: float = 0.0
    reduce_train_summed_gbps: float = 0.0
    adamw_train_summed_model_params: int = 0
    # the fused CPU AdamW (as adamw_params_per_s) while pinned H2D and D2H copies ran on every GPU
    # (measure.adamw_beside_copies): what the updaters reach in training. 0: not measured.
    adamw_beside_copies_params_per_s: float = 0.0
    adamw_beside_copies_gpus: int = 0  # how many GPUs copied beside it
    # until a run or the measurement above gives the updaters' rate, the share of the bare kernel's rate
    # the planner charges: about the median of first runs on one H200 since the manifest fix (docs/tuning.md,
    # "The updaters' share after the manifest fix"). 1.0 charges the bare rate.
    adamw_train_fraction: float = 0.8
    # the lowest share measured in training (the manifest's per-chunk cost taken out; docs/tuning.md, "The
    # planner's constants"); a first plan's device-held layers also hold at it
    adamw_train_fraction_low: float = 0.46
    # host memory, GB/s of bytes moved (planner/host_bandwidth.py): reading, writing, copying (read + write), every
    # NUMA node on its own memory, added up; with the bare AdamW's bytes, the largest bounds a step's host traffic
    # (host_peak_gbps, step_model.host_bound_s). 0: not measured (a cache file from before it: load_or_calibrate
    # measures it)
    host_read_gbps: float = 0.0
    host_write_gbps: float = 0.0
    host_copy_gbps: float = 0.0
    host_node_copy_gbps: str = ""  # each node's copy rate, "44.1,40.3", where there are several
    # a host-held embedding's batch rows reaching the GPU as a worker gathers them (measure.embedding_rows_rate),
    # GB/s of the fp32 table: "device" (the GPU reads them in place through the store's mapping) or "cpu" (no
    # mapping: the rank's CPU threads gather them, the GPU waiting). 0 / "": not measured (CPU workers)
    embedding_rows_gbps: float = 0.0
    embedding_rows_gather: str = ""
    # the GPU blocks measured at plan time for the job's shape (measure.py); kept in their own cache file
    blocks: MeasuredBlocks | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _MAY_BE_ZERO and value == 0:
                continue
            if f.type in ("float", "int") and not (math.isfinite(value) and value > 0):
                raise CalibrationError(f"calibration field {f.name} must be a positive finite number, got {value!r}")

    @property
    def host_rates_gbps(self) -> dict[str, float]:
        """What the host's memory moved in each workload the calibration timed, GB/s: reading, copying, and the bare
        fused AdamW on every core (hosttraffic.ADAMW_BYTES per parameter). Empty where host memory was not measured
        (a cache file from before it)."""
        if not (self.host_read_gbps or self.host_copy_gbps):
            return {}
        return {"read": self.host_read_gbps, "copy": self.host_copy_gbps,
                "AdamW": self.adamw_params_per_s * ADAMW_BYTES / 1e9}

    @property
    def host_peak_gbps(self) -> float:
        """The most the host's memory moved when measured, the largest of host_rates_gbps (0: not measured). The
        AdamW figure counts: on one H200 machine three calibrations minutes apart read 139.8, 80.7 and 89.3 GB/s
        while the same kernel moved 124, 112 and 109, and the updaters in training did not slow (docs/tuning.md,
        "The host bound")."""
        rates = self.host_rates_gbps
        return max(rates.values()) if rates else 0.0

    @property
    def embedding_rows_how(self) -> str:
        """How a host-held embedding's rows reach the GPU on this host, in words."""
        return {"device": "read by the GPU in place through the store's mapping",
                "cpu": "gathered on the CPU: the store's memory is not mapped for the GPU"}.get(
                    self.embedding_rows_gather, "not measured")

    def to_dict(self) -> dict[str, Any]:
        """The calibration's figures (the blocks travel apart: `blocks.to_dict()`)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "blocks"}

    @classmethod
    def from_dict(cls, d: dict[str, Any], blocks: MeasuredBlocks | None = None) -> "Calibration":
        d = old_names.current(d)  # a cache file written before a field was renamed
        names = {f.name for f in dataclasses.fields(cls)} - {"blocks"}
        unknown = sorted(set(d) - names)
        if unknown:
            raise CalibrationError(f"calibration has unknown fields {unknown}")
        missing = sorted(f.name for f in dataclasses.fields(cls) if f.name not in d and f.default is dataclasses.MISSING)
        if missing:
            raise CalibrationError(f"calibration is missing fields {missing}")
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        conv = {"str": str, "float": float, "int": int}
        return cls(**{k: conv[kinds[k]](v) for k, v in d.items()}, blocks=blocks)

    def summary(self) -> str:
        return (
            f"{self.device_name} @ {self.host}: H2D {self.h2d_gbps:.1f} GB/s, D2H {self.d2h_gbps:.1f}, "
            f"both {self.bidir_gbps:.1f}; "
            + (f"host memory copy {self.host_copy_gbps:.1f} GB/s (read {self.host_read_gbps:.1f}, write "
               f"{self.host_write_gbps:.1f}" + (f"; per NUMA node {self.host_node_copy_gbps}" if self.host_node_copy_gbps
                                                else "") + "); " if self.host_copy_gbps else "")
            + f"CPU AdamW {self.adamw_params_per_s / 1e9:.2f} G params/s "
            f"({self.adamw_threads} threads"
            + (f"; {self.adamw_beside_copies_params_per_s / 1e9:.2f} beside copies" if self.adamw_beside_copies_params_per_s else "")
            + f"); reduce {self.reduce_gbps:.1f} GB/s; "
            + (f"embedding rows {self.embedding_rows_gbps:.1f} GB/s ({self.embedding_rows_how}); "
               if self.embedding_rows_gbps else "")
            + (f"GPU blocks measured for this shape ({len(self.blocks.layers)} layer and {len(self.blocks.losses)} "
               f"loss sizes)" if self.blocks else f"GPU {self.device_tflops:.1f} TFLOP/s effective")
            + (f"; GPU links {self.allreduce_gbps:.0f} GB/s among {self.bus_gpus}, H2D of all "
               f"{self.h2d_total_gbps:.0f} GB/s" if self.bus_gpus > 1 else "")
            + (f"; AdamW in training {self.adamw_train_params_per_s / 1e9:.2f} G params/s "
               f"(measured training a {self.adamw_train_model_params:,}-param model)" if self.adamw_train_params_per_s else "")
            + (f"; beside a host sum of ranks' gradients AdamW {self.adamw_train_summed_params_per_s / 1e9:.2f} G params/s"
               + (f" and the sum {self.reduce_train_summed_gbps:.1f} GB/s" if self.reduce_train_summed_gbps else "")
               + f" (measured training a {self.adamw_train_summed_model_params:,}-param model)"
               if self.adamw_train_summed_params_per_s else "")
        )

    def update_rate_learned(self, model_params: int, summed: bool = False) -> bool:
        """Whether a run of this model on this host measured the updaters' rate in training (summed:
        in a run whose aggregator summed ranks' gradients beside them)."""
        if summed:
            return bool(self.adamw_train_summed_params_per_s) and self.adamw_train_summed_model_params == model_params
        return bool(self.adamw_train_params_per_s) and self.adamw_train_model_params == model_params

    def update_params_per_s(self, model_params: int, summed: bool = False) -> float:
        """The AdamW rate the planner charges for a model: the one measured training it (beside a host
        sum where `summed`, when a run measured that), else the larger of the rate measured beside
        copies and the bare kernel's times adamw_train_fraction: the probe's copies never pause, and in
        training, where they pause, the updaters ran faster than the probe (docs/tuning.md, "What a
        first plan charges the updaters")."""
        if summed and self.update_rate_learned(model_params, summed=True):
            return self.adamw_train_summed_params_per_s
        if self.update_rate_learned(model_params):
            return self.adamw_train_params_per_s
        return max(self.adamw_beside_copies_params_per_s, self.adamw_params_per_s * self.adamw_train_fraction)

    def at_lowest_share(self, model_params: int) -> "Calibration | None":
        """While the updaters' rate is a share of the bare kernel's (neither a run of this model nor the
        calibration measured it in training): this calibration charging the lowest share measured in
        training (None once a rate is measured, or when the lowest share is not below the one charged)."""
        if (self.update_rate_learned(model_params) or self.adamw_beside_copies_params_per_s
                or self.adamw_train_fraction_low >= self.adamw_train_fraction):
            return None
        return dataclasses.replace(self, adamw_train_fraction=self.adamw_train_fraction_low)

    def reduce_rate_gbps(self, model_params: int, summed: bool = False) -> float:
        """The aggregator's rate the planner charges: measured beside the updaters where a run of this
        model summed ranks' gradients, else the bare calibrated sum."""
        if summed and self.update_rate_learned(model_params, summed=True) and self.reduce_train_summed_gbps:
            return self.reduce_train_summed_gbps
        return self.reduce_gbps


# A reference host's building blocks, for tests and examples (docs/tuning.md: how each was had).
REFERENCE_CALIBRATION = Calibration(
    host="h200-reference",
    device_name="NVIDIA H200",
    h2d_gbps=55.0,
    d2h_gbps=55.0,
    bidir_gbps=95.0,
    adamw_params_per_s=4.4e9,
    adamw_threads=16,
    reduce_gbps=41.0,
    device_tflops=405.0,
    device_mem_bytes=143_771 * (1 << 20),
    device_adamw_params_per_s=1.0e11,
    allreduce_gbps=100.0,
)


# --------------------------------------------------------------------------------------
# measurement

def _median_time(fn: Callable[[], None], sync: Callable[[], None], reps: int) -> float:
    """Median seconds of fn after one warm-up run (allocation, first-touch, kernel selection)."""
    return timed(fn, sync, reps, warmup=1)


def fused_adamw(params: list, grads: list, m: list, v: list, steps: list) -> None:
    import torch

    torch._fused_adamw_(
        params, grads, m, v, [], steps, lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
        amsgrad=False, maximize=False,
    )


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


def _device_name(device: str) -> str:
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
# (docs/tuning.md, "A fresh machine's first minute"). Something running beside a probe lowers a
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


def remeasure_host(device: str = "cuda", cache_dir: str | os.PathLike | None = None, quick: bool = False,
                   gpus: int = 1, model_params: int | None = None,
                   measure: Callable[..., Mapping[str, Any]] | None = None) -> Calibration:
    """The cached calibration with HOST_RATE_FIELDS measured again (`measure`, default host_rates), each
    the better of the cached and the new figure (the cache keeps it). Needs a cached calibration
    (load_or_calibrate first)."""
    path = cache_path(device, cache_dir)
    with locked(path):
        calib, learned = _read(path)
        again = (measure or host_rates)(device, calib.adamw_threads, max(1, calib.adamw_beside_copies_gpus or gpus), quick)
        better = {f: float(again[f]) for f in HOST_RATE_FIELDS if again.get(f, 0) > getattr(calib, f)}
        if "host_copy_gbps" in better:  # the nodes' rates go with the copy rate they add up to
            better["host_node_copy_gbps"] = str(again.get("host_node_copy_gbps", ""))
        if "embedding_rows_gbps" in better:  # and the way the rows were gathered with their rate
            better["embedding_rows_gather"] = str(again.get("embedding_rows_gather", ""))
        changes = [f"{f} {getattr(calib, f):.4g} -> {again[f]:.4g}" for f in HOST_RATE_FIELDS if f in again]
        _log.info("measured the host again after the blocks (each keeps the better): %s", "; ".join(changes))
        if better:
            calib = dataclasses.replace(calib, **better)
            calib = dataclasses.replace(calib, bidir_gbps=max(calib.bidir_gbps, calib.h2d_gbps, calib.d2h_gbps))
            save(calib, path, learned)
    return _for_model(calib, learned, model_params)


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
    del host_in, host_out, dev_in, dev_out
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
        del src, dst
        k = 512 if quick else 2048
        x, w = torch.rand(k, k), torch.rand(k, k)
        matmul = 2 * k**3 / _median_time(lambda: torch.mm(x, w), cpu_sync, reps) / 1e12
        return Calibration(
            host=socket.gethostname(), device_name=_device_name("cpu"),
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
    del x, w
    device_adamw = _adamw_rate((16 if quick else 64) << 20, device, sync, reps)
    torch.cuda.empty_cache()
    return Calibration(
        host=socket.gethostname(), device_name=_device_name(device),
        **pcie, adamw_params_per_s=adamw, adamw_threads=torch.get_num_threads(), reduce_gbps=reduce_gbps,
        device_tflops=matmul * LAYER_EFFICIENCY,
        device_mem_bytes=int(torch.cuda.get_device_properties(dev).total_memory),
        device_adamw_params_per_s=device_adamw, **embedding_rows_fields(device, quick),
    )


# --------------------------------------------------------------------------------------
# cache

def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "unknown"


def cache_path(device: str, cache_dir: str | os.PathLike | None = None) -> Path:
    return _cache_file(socket.gethostname(), _device_name(device), cache_dir)


def cache_root(env: Mapping[str, str] | None = None) -> Path:
    """Where host calibrations are kept: $SLIDEDP_CACHE_DIR, else $XDG_CACHE_HOME/slidedp, else
    ~/.cache/slidedp. The test suite points SLIDEDP_CACHE_DIR elsewhere: a calibration measured
    while its tests load the host would be kept and charged to the user's next plans."""
    env = os.environ if env is None else env
    if env.get("SLIDEDP_CACHE_DIR"):
        return Path(env["SLIDEDP_CACHE_DIR"]).expanduser()
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]).expanduser() / "slidedp"
    return Path("~/.cache/slidedp").expanduser()


def _cache_file(host: str, device_name: str, cache_dir: str | os.PathLike | None) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir else cache_root()
    return root / f"calibration-{slug(host)}-{slug(device_name)}.json"


def _learned_model(fields: Mapping[str, Any]) -> int:
    """The parameter count of the model whose training measured `fields` (0: none)."""
    return next((int(fields[m]) for m in LEARNED_GROUPS if fields.get(m)), 0)


def _with_learned(calib: Calibration, fields: Mapping[str, Any]) -> Calibration:
    """calib carrying exactly `fields` of what training runs measured (nothing else learned; the runs
    each figure is the median of stay in the cache file)."""
    return dataclasses.replace(calib, **{**_NOTHING_LEARNED, **{k: v for k, v in fields.items() if k != _RECENT}})


def _learned_of(calib: Calibration) -> dict[int, dict[str, Any]]:
    """A calibration's own learned fields, per model (a file from before the per-model figures held
    each group of them for the model that group names)."""
    out: dict[int, dict[str, Any]] = {}
    for model_key, values in LEARNED_GROUPS.items():
        if getattr(calib, model_key):
            out.setdefault(getattr(calib, model_key), {}).update(
                {model_key: getattr(calib, model_key), **{v: getattr(calib, v) for v in values}})
    return out


# A model's learned rate is the median of what its last RECENT_RUNS runs on this host measured: on one
# H200 the updaters' rate moved by up to 26% from one run of a plan to the next (2.45-3.16 G params/s in
# five runs of one model; docs/tuning.md), and a plan that charged the last run's figure alone was 18% off.
RECENT_RUNS = 5
_RECENT = "recent"  # a learned entry's key for those runs' figures, per field


def _merged(entry: Mapping[str, Any], measured: Mapping[str, Any]) -> dict[str, Any]:
    """A model's figures updated by a run's: each measured rate becomes the median of the model's last
    RECENT_RUNS runs that measured it (an entry from before the runs were kept counts as one run);
    fields the run did not measure are kept."""
    recent = {k: list(v) for k, v in entry.get(_RECENT, {}).items()}
    out = {**entry, **measured}
    for field, value in measured.items():
        if field in LEARNED_GROUPS:  # the model's parameter count, not a rate
            continue
        runs = recent.get(field) or ([entry[field]] if entry.get(field) else [])
        recent[field] = [*runs, value][-RECENT_RUNS:]
        out[field] = statistics.median(recent[field])
    out[_RECENT] = recent
    return out


def _checked_recent(recent: Any) -> dict[str, list[float]] | None:
    """A learned entry's recent runs, or None when they are not lists of up to RECENT_RUNS positive rates."""
    rates = set(LEARNED_FIELDS) - set(LEARNED_GROUPS)
    if not (isinstance(recent, dict) and set(recent) <= rates and all(
            isinstance(v, list) and 0 < len(v) <= RECENT_RUNS and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in v)
            for v in recent.values())):
        return None
    return {k: [float(x) for x in v] for k, v in recent.items()}


@contextlib.contextmanager
def locked(path: Path):
    """Serialize the read-modify-write of a cache file among the jobs of one host."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def record_training(calib: Calibration, cache_dir: str | os.PathLike | None = None, **measured: Any) -> Calibration:
    """Keep what a training run measured (the `*_train_*` fields of one model) with the host's
    calibration (the file `calib` came from; no CUDA needed to find it), for the next plan of that
    model: beside what runs of other models measured, and over what earlier runs of this model did
    (`_merged`). Returns the file's calibration with this model's figures. Raises OSError where the
    cache cannot be written."""
    unknown = sorted(k for k in measured if k not in LEARNED_FIELDS)
    if unknown:
        raise ValueError(f"record_training: {unknown} are not measured in training")
    model = _learned_model(measured)
    if not model:
        raise ValueError("record_training: the measured fields name no model (a *_model_params field)")
    path = _cache_file(calib.host, calib.device_name, cache_dir)
    with locked(path):
        try:
            current, learned = _read(path)
        except CalibrationError as e:  # unreadable: what this run measured starts a new file
            _log.warning("rewriting %s: %s", path, e)
            current, learned = _with_learned(calib, {}), {}
        learned[model] = _merged(learned.get(model, {}), measured)
        save(current, path, learned)
    return _with_learned(current, learned[model])


def save(calib: Calibration, path: str | os.PathLike, learned: Mapping[int, Mapping[str, Any]] | None = None) -> None:
    """Write a calibration's measured building blocks and, per model, what training runs measured
    (`learned`; a calibration's own learned fields are not kept)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    figures = {k: v for k, v in _with_learned(calib, {}).to_dict().items() if k not in MODEL_SHARES}
    doc: dict[str, Any] = {"schema": SCHEMA, "calibration": figures}
    if learned:
        doc["learned"] = {str(k): dict(v) for k, v in sorted(learned.items())}
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def _checked_entry(calib: Calibration, key: Any, fields: Any) -> dict[str, Any] | None:
    """A model's learned entry with its values converted, or None when it is not one: fields that are
    not measured in training, values of the wrong kind, a model named other than its key."""
    if not (isinstance(fields, dict) and str(key).isdigit() and set(fields) <= set(LEARNED_FIELDS)):
        return None
    try:
        full = Calibration.from_dict({**calib.to_dict(), **_NOTHING_LEARNED, **fields})
    except (CalibrationError, TypeError, ValueError):
        return None
    entry = {k: getattr(full, k) for k in fields}
    if any(entry.get(m, int(key)) != int(key) for m in LEARNED_GROUPS):
        return None
    return entry


def _read(path: str | os.PathLike) -> tuple[Calibration, dict[int, dict[str, Any]]]:
    """A cache file's calibration (nothing learned in it) and what runs measured, per model. An
    entry that is not a model's measured fields is left out, with a warning naming it."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CalibrationError(f"cannot read calibration {path}: {e}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("calibration"), dict):
        raise CalibrationError(f"calibration {path} is not a schema-{SCHEMA} calibration file")
    retired = sorted(set(doc["calibration"]) & set(RETIRED_FIELDS))
    try:
        calib = Calibration.from_dict({k: v for k, v in doc["calibration"].items()
                                       if k not in RETIRED_FIELDS and k not in MODEL_SHARES})
    except (TypeError, ValueError) as e:
        raise CalibrationError(f"calibration {path}: {e}") from None
    learned = _learned_of(calib)  # a file from before the per-model figures
    entries = doc.get("learned") or {}
    for key, fields in (entries.items() if isinstance(entries, dict) else ()):
        if isinstance(fields, dict) and set(fields) & set(RETIRED_FIELDS):
            retired = sorted(set(retired) | (set(fields) & set(RETIRED_FIELDS)))
            fields = {k: v for k, v in fields.items() if k not in RETIRED_FIELDS}
            if not fields:
                continue
        runs = fields.get(_RECENT) if isinstance(fields, dict) else None
        if runs is not None:
            fields = {k: v for k, v in fields.items() if k != _RECENT}
        entry = _checked_entry(calib, key, fields)
        if entry is None:
            _log.warning("%s: learned entry %r is not a model's measured fields; left out", path, key)
            continue
        if runs is not None:
            recent = _checked_recent(runs)
            if recent is None:  # the figures stay; the next run starts the list anew from them
                _log.warning("%s: learned entry %r: its recent runs are not lists of up to %d rates; left out",
                             path, key, RECENT_RUNS)
            else:
                entry[_RECENT] = {k: v for k, v in recent.items() if k in entry}
        learned[int(key)] = entry
    if retired:
        _log.info("%s: %s (GPU-time factors learned from runs) ignored: plans now measure the GPU work at "
                  "the job's shapes; the next write drops them", path, ", ".join(retired))
    return _with_learned(calib, {}), learned


def _for_model(calib: Calibration, learned: Mapping[int, Mapping[str, Any]], model_params: int | None) -> Calibration:
    return calib if model_params is None else _with_learned(calib, learned.get(int(model_params), {}))


def load(path: str | os.PathLike, model_params: int | None = None) -> Calibration:
    """The calibration of a cache file; with model_params, carrying what training runs of that model
    measured (none: nothing learned)."""
    return _for_model(*_read(path), model_params)


def load_or_calibrate(
    device: str = "cuda", cache_dir: str | os.PathLike | None = None, quick: bool = False, refresh: bool = False,
    gpus: int = 1, model_params: int | None = None,
) -> Calibration:
    """The cached calibration of this host and device, measured (and cached) if absent or unreadable.
    gpus > 1: also the GPU links among that many GPUs (measured once, kept in the same file).
    model_params: with what training runs of that model on this host measured (`load`).
    refresh: measure again and forget what training runs measured (after a hardware change)."""
    path = cache_path(device, cache_dir)
    with locked(path):  # one job measures at a time: two at once would measure each other
        calib, learned = None, {}
        if path.exists() and not refresh:
            try:
                calib, learned = _read(path)
            except CalibrationError as e:
                _log.warning("recalibrating: %s", e)
        changed = fresh = calib is None
        if calib is None:
            calib = calibrate(device, quick=quick)
            _log.info("calibrated %s", calib.summary())
        if gpus > 1:
            gpus = min(gpus, _visible_gpus(device))  # asked for more than are visible: the visible ones (CPU: 1)
        if gpus > 1 and calib.bus_gpus < gpus:
            from slidedp.planner.links import measure_links

            links = measure_links(gpus)
            calib = dataclasses.replace(calib, allreduce_gbps=links["bus_gbps"],
                                        h2d_total_gbps=links["h2d_total_gbps"], bus_gpus=gpus)
            _log.info("measured the links among %d GPUs: %.0f GB/s bus, %.0f GB/s of copy-in in all", gpus,
                      calib.allreduce_gbps, calib.h2d_total_gbps)
            changed = True
        if not fresh and not calib.host_copy_gbps:  # a cache file from before host memory was measured
            calib = dataclasses.replace(calib, **host_memory_fields(quick))
            _log.info("measured this host's memory: copy %.1f GB/s (read %.1f, write %.1f)", calib.host_copy_gbps,
                      calib.host_read_gbps, calib.host_write_gbps)
            changed = True
        if device.startswith("cuda") and not fresh and not calib.embedding_rows_gbps:  # a cache from before it
            calib = dataclasses.replace(calib, **embedding_rows_fields(device, quick))
            if calib.embedding_rows_gbps:
                _log.info("a host-held embedding's rows reach the GPU at %.1f GB/s (%s)", calib.embedding_rows_gbps,
                          calib.embedding_rows_how)
                changed = True
        if device.startswith("cuda") and calib.adamw_beside_copies_gpus < gpus:
            from slidedp.planner.measure import adamw_beside_copies

            rate = adamw_beside_copies(calib.adamw_threads, device, gpus)
            calib = dataclasses.replace(calib, adamw_beside_copies_params_per_s=rate, adamw_beside_copies_gpus=gpus)
            _log.info("the fused CPU AdamW ran at %.2f G params/s beside pinned copies on %d GPU(s) (bare: %.2f)",
                      rate / 1e9, gpus, calib.adamw_params_per_s / 1e9)
            changed = True
        if changed:
            save(calib, path, learned)
            _log.info("calibration cached in %s", path)
    return _for_model(calib, learned, model_params)


def _visible_gpus(device: str) -> int:
    if not device.startswith("cuda"):
        return 1
    import torch

    return torch.cuda.device_count()
