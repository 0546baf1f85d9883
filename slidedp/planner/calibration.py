"""What the planner knows of a host: the `Calibration` record and a reference host's.

A calibration holds the building blocks the step-time model charges: pinned H2D, D2H and both at
once; the fused CPU AdamW (`torch._fused_adamw_`, the kernel the updater runs) bare and beside pinned
copies; an fp32 sum (the aggregator); a layer-sized matmul in the compute dtype and the fused AdamW on
the device (for an embedding kept on the GPU); the links among the GPUs; host memory; how a host-held
embedding's rows reach the GPU; and what training runs of a model measured (the updaters' rate, and
beside a host sum of ranks' gradients that sum's rate). The GPU work of a step itself is measured per
shape at plan time (measure.py) and rides along as `Calibration.blocks`.

calibrate.py measures a host, cache.py keeps what was measured (and what runs learned) per host and
device; this module is the record alone, so reading a plan needs neither.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slidedp import old_names
from slidedp.hosttraffic import ADAMW_BYTES

if TYPE_CHECKING:
    from slidedp.planner.measure import MeasuredBlocks


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
NOTHING_LEARNED: dict[str, Any] = {k: 0 for k in LEARNED_FIELDS}
# Fields of older cache files that nothing reads now: runs' GPU-time factors per model and shape of
# GPU work, replaced by the GPU blocks measured at plan time (measure.py). Dropped on reading, with a note.
RETIRED_FIELDS = ("gpu_train_factors", "gpu_train_model_params")
# The step model's shares of the bare AdamW rate: constants of this checkout, not measurements of the
# host. A cache does not keep them (one written with them charges this checkout's, not its own).
MODEL_SHARES = ("adamw_train_fraction", "adamw_train_fraction_low")

# The network between hosts (several hosts: docs/multi-host.md, "The step model"): no host can measure it before
# the hosts are together, so a plan assumes these until a run on several hosts has measured it (its ranks' probe,
# worker/netprobe.py, kept by planner/netcache.py) or the job sets its own (runtime.network_gbps,
# runtime.network_latency_us): 100 Gb/s, each way, per host, and 20 us per step of a ring, about what NCCL's
# rings reach over a 100 GbE fabric's line rate and a hop's latency. Not kept in the calibration's cache file:
# the measured figures have a file of their own (netcache.py), the job's are the job's.
DEFAULT_INTERNODE_GBPS = 12.5
DEFAULT_INTERNODE_LATENCY_US = 20.0
NETWORK_FIELDS = ("internode_gbps", "internode_latency_us", "internode_source", "internode_latency_source",
                  "internode_at_least")

# 0 = not measured yet: what training runs measure, the host's copy-in with every GPU at once, the
# AdamW rate beside the copies (measured on CUDA only), and host memory (a cache file from before it);
# the network between hosts (0: the assumed defaults above)
_MAY_BE_ZERO = frozenset(LEARNED_FIELDS) | {"h2d_total_gbps", "adamw_beside_copies_params_per_s",
                                            "adamw_beside_copies_gpus", "host_read_gbps", "host_write_gbps",
                                            "host_copy_gbps", "embedding_rows_gbps", "internode_gbps",
                                            "internode_latency_us", "internode_at_least"}



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
    # the planner charges: about the median of first runs on one H200 since the manifest fix
    # (benchmarks/RESULTS.md, "The updaters' share of the bare AdamW kernel"). 1.0 charges the bare rate.
    adamw_train_fraction: float = 0.8
    # the lowest share measured in training (the manifest's per-chunk cost taken out; docs/planner.md, "The
    # constants"); a first plan's device-held layers also hold at it
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
    # the network between hosts, for a job on several hosts: GB/s each way through one host's link (its ranks
    # share it), and the latency of one step of a ring over it. 0: not known (DEFAULT_INTERNODE_GBPS and
    # _LATENCY_US assumed). internode_source and internode_latency_source say where each figure came from ("":
    # assumed, "job": the job file's runtime.network_gbps / network_latency_us, or the words of a measurement:
    # "measured by the run of 2026-12-05", netcache.MeasuredNetwork.source); internode_at_least = 1: the
    # measured rate was the GPU links' within the host, which bounded the collectives, so the network reached at
    # least that. Not kept by the calibration's cache file (NETWORK_FIELDS).
    internode_gbps: float = 0.0
    internode_latency_us: float = 0.0
    internode_source: str = ""
    internode_latency_source: str = ""
    internode_at_least: int = 0
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
        while the same kernel moved 124, 112 and 109, and the updaters in training did not slow (the journal "The host bound" of docs/tuning.md, in git history)."""
        rates = self.host_rates_gbps
        return max(rates.values()) if rates else 0.0

    @property
    def internode_rate_gbps(self) -> float:
        """GB/s each way through one host's network link: measured or the job's, else DEFAULT_INTERNODE_GBPS."""
        return self.internode_gbps or DEFAULT_INTERNODE_GBPS

    @property
    def internode_latency_s(self) -> float:
        """Seconds per step of a ring over the network between hosts: measured or the job's, else
        DEFAULT_INTERNODE_LATENCY_US."""
        return (self.internode_latency_us or DEFAULT_INTERNODE_LATENCY_US) * 1e-6

    def network_words(self) -> str:
        """The network between hosts the plan charges, and where each figure came from."""
        def said(value: float, source: str) -> str:
            if not value:
                return "assumed"
            return {"job": "set by the job", "": "given"}.get(source, source)

        rate = self.internode_rate_gbps
        least = "at least " if self.internode_gbps and self.internode_at_least else ""
        return (f"network between hosts: {least}{rate:.1f} GB/s ({rate * 8:g} Gb/s) each way per host, "
                f"{said(self.internode_gbps, self.internode_source)}"
                + (" (the GPU links within the host bounded the collectives measured)" if least else "")
                + f"; latency {self.internode_latency_s * 1e6:g} us per ring step, "
                f"{said(self.internode_latency_us, self.internode_latency_source or self.internode_source)}")

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
        training, where they pause, the updaters ran faster than the probe (the journal "What a first plan charges the updaters" of docs/tuning.md, in git history)."""
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


# A reference host's building blocks, for tests and examples (docs/planner.md, "The constants").
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
