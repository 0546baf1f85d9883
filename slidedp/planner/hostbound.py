"""What host memory costs a plan's step, and, where the host bounds it, what would help: `--plan` prints it.

The host's share of a step is fixed by the model and the plan (every streamed parameter's copies in,
its gradient out, its AdamW), the GPU's grows with the tokens; so a step is host-bound at small
batches and budgets, and the levers are the ones that move the balance: more tokens per step, a
larger GPU budget (layers held on the device have no copies, gradient or host update; resident
layers no second copy), and the bf16 delivery (half the bytes of every copy in).
"""

from __future__ import annotations

import math
from dataclasses import replace

from slidedp.jobrecord import sums_on_host
from slidedp.model import moe_shape
from slidedp.planner import costs
from slidedp.planner.calibration import Calibration
from slidedp.planner.costs import GiB
from slidedp.planner.step_model import host_traffic
from slidedp.planner.workload import Workload
from slidedp.stepplan import StepPlan

_WHAT = (("fetch", "copies in"), ("grads", "gradients out"), ("offload", "offloaded inputs"),
         ("update", "AdamW"), ("sum", "sums of ranks"))


def host_bound(busy: dict[str, float]) -> tuple[str, float] | None:
    """(what, seconds) of the host's work that outlasts the GPU's in a step: host memory traffic, the
    updaters or the aggregator's sums; None where the GPU is the longer."""
    name, seconds = max((("host memory traffic", busy.get("host", 0.0)), ("the updaters' AdamW", busy["update"]),
                         ("the aggregator's sums", busy["reduce"])), key=lambda x: x[1])
    return (name, seconds) if seconds > busy["device"] else None


def host_lines(work: Workload, ch: StepPlan, calib: Calibration, busy: dict[str, float]) -> list[str]:
    """The plan's host bytes per parameter per step and their bound; when the host bounds the step, what helps."""
    n = work.model.num_parameters()
    traffic = host_traffic(work, ch)
    total = sum(traffic.values())
    parts = ", ".join(f"{label} {traffic[k] / n:.1f}" for k, label in _WHAT if traffic[k])
    line = f"host memory per step: {total / n:.1f} B/param ({parts})"
    if calib.host_peak_gbps:
        rates = calib.host_rates_gbps
        which = max(rates, key=rates.get)
        line += f"; at the host's measured {which} rate of {calib.host_peak_gbps:.1f} GB/s: {busy['host']:.3f} s"
    else:
        line += "; the host's memory bandwidth was not measured (an old calibration): no bound"
    lines = ["", line]
    bound = host_bound(busy)
    if bound is None:
        return lines
    what, seconds = bound
    lines.append(f"the host bounds the step: {what} takes {seconds:.3f} s per step, the GPU {busy['device']:.3f} s. "
                 f"What would help:")
    lines += [f"  - {a}" for a in advice(work, ch, total, seconds / busy["device"], what)]
    return lines


def advice(work: Workload, ch: StepPlan, total: int, over: float, what: str = "") -> list[str]:
    """The levers, each with what it changes; over: the host's time over the GPU's; what: which of the host's
    work bounds the step (host_bound's name)."""
    out = []
    m = work.model
    if moe_shape.is_moe(m):
        active = costs.active_layer_params(m) / costs.layer_params(m)
        out.append(f"this Mixture-of-Experts model's GPU work is that of its active parameters ({active:.0%} of each "
                   f"layer's: {moe_shape.experts_per_token(m)} of {moe_shape.num_experts(m)} experts a token), the "
                   "host's copies, sums and AdamW that of all of them: it is host-bound at batches where a dense model "
                   "of its size is not, and the levers below move the balance")
    if what == "the updaters' AdamW":
        out.append(f"more updater cores or memory bandwidth: the updaters' AdamW runs over every host parameter "
                   f"({costs.host_updated_params(m, ch.embedding, ch.device_layers) / 1e9:.2f} B a step) on "
                   f"{work.updaters} updater process(es) (runtime.updaters: one per NUMA node by default, each on its "
                   "node's cores); a host with more of either, or fewer other processes on it")
    if what == "the aggregator's sums" or (what and sums_on_host(work.world, ch.grad_route)):
        out.append(f"the aggregator sums {work.world} ranks' whole gradients in host memory: plan.grad_route = "
                   "\"reduce_scatter\" sums them on the GPUs (each rank copies out 1/N, nothing to sum), or fewer "
                   "ranks sum less")
    unit = work.world * (ch.micro_batch or work.micro_batch or 1)
    batch = math.ceil(work.global_batch * over / unit) * unit
    out.append(f"more tokens per step: the host's work per step stays, the GPU's grows with the tokens; "
               f"train.global_batch = {batch} (now {work.global_batch}) would give the GPU about as long as the host")
    p_layer = costs.layer_params(m)
    streamed = m.num_layers - ch.device_layers
    if streamed > 0:
        held = host_traffic(work, replace(ch, device_layers=ch.device_layers + 1,
                                          resident_layers=min(ch.resident_layers, streamed - 1)))
        saves = (total - sum(held.values())) / m.num_parameters()
        out.append(f"a larger memory.device_budget_gib: each layer more held on the device (plan.device_layers) "
                   f"takes {p_layer * (12 + costs.dtype_bytes(work.compute_dtype) + costs.GRAD_BYTES) / GiB:.2f} GiB of "
                   f"it and {saves:.2f} B/param off the host's traffic per step (its copies, gradient and AdamW)")
    if ch.delivery == "fp32" and work.compute_dtype == "bf16":
        saves = (total - sum(host_traffic(work, replace(ch, delivery="bf16")).values())) / m.num_parameters()
        if saves > 0:  # its copies in are half the bytes; the updaters refresh the shadow (hosttraffic.py)
            out.append(f"the bf16 delivery (plan.delivery = \"bf16\", on a store made with store.shadow_bf16; 2 "
                       f"B/param more host memory): {saves:.1f} B/param less per step, the same bits")
    return out
