"""Whether the host has room for a job, asked before anything is made.

A job needs host memory for its store's state (created by the job where it does not exist), its
gradient rings (with exact clipping one slot per host chunk: every gradient of a step stays until
the step's norm), the buffers its ranks keep offloaded layer inputs in, and its processes. The
store refuses a state it has no room for, but the rest came after it: on the H200 host (125 GiB)
a Qwen3-8B job with clipping created its 91.5 GiB store and 30.9 GiB of rings, and the host-state
daemon was killed for memory in step 0.

Here is the arithmetic of it, on the numbers the caller read from the host; admission.py asks it
before the plan and once planned, for the launcher and the dry run alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from slidedp.config import JobConfig
from slidedp.jobrecord import gradient_space, held_chunk_ids, held_unit_names, ring_slots
from slidedp.planner import HostRoom
from slidedp.planner.costs import activation_bytes
from slidedp.stepplan import StepPlan
from slidedp.store.layout import Layout
from slidedp.store.rings import rings_bytes
from slidedp.store.shm import SHM_DIR
from slidedp.store.part import StorePart
from slidedp.store.store import held_sizes

GiB = 1 << 30


def size(n: float) -> str:
    """Bytes as a person reads them: GiB from a tenth of one, else MiB (a tiny job's store is a few)."""
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 else f"{n / 2**20:.1f} MiB"

# Host memory of the job's processes per rank: a worker with its share of the launcher and daemons
# (8.5 GiB measured for one rank on the H200, CUDA context and pinned staging included; a CPU rank
# of the tiny job about 0.9 GiB: the journal "Host memory a job needs" of docs/tuning.md, in git history).
PROCESS_BYTES = {"cuda": 8 * GiB, "cpu": 1 * GiB}


@dataclass(frozen=True)
class HostNeed:
    state: int  # the store's state to create in /dev/shm (0: the store exists)
    rings: int  # the gradient rings, in /dev/shm
    processes: int  # the job's processes' memory, beside them
    world: int
    rings_per_chunk: bool  # exact clipping's ring: a slot per host chunk
    shadow: bool = False  # the state holds the bf16 shadow (14 B/param, not 12)
    offload: int = 0  # the ranks' page-locked buffers for offloaded layer inputs (not in /dev/shm)
    offload_layers: int = 0

    @property
    def shm(self) -> tuple[tuple[str, int], ...]:
        """What lives in /dev/shm (the store to create, the rings) -> bytes."""
        state = ((f"the store's state ({14 if self.shadow else 12} B/param)", self.state),) if self.state else ()
        return state + (("gradient rings" + (" (exact clipping: a slot per host chunk)" if self.rings_per_chunk else ""),
                         self.rings),)

    @property
    def items(self) -> tuple[tuple[str, int], ...]:
        buffers = ((f"offloaded inputs of {self.offload_layers} layer(s)", self.offload),) if self.offload else ()
        return self.shm + buffers + ((f"the job's processes ({self.world} rank(s))", self.processes),)

    @property
    def shm_bytes(self) -> int:
        return sum(b for _, b in self.shm)

    @property
    def total(self) -> int:
        return self.shm_bytes + self.offload + self.processes

    def describe(self) -> str:
        return ", ".join(f"{what} {size(b)}" for what, b in self.items)


def job_part(job: JobConfig) -> StorePart | None:
    """The part of the state this host's store holds (several hosts: docs/multi-host.md)."""
    rt = job.runtime
    return StorePart.for_hosts(rt.nnodes, rt.node_rank, rt.workers)


def process_bytes(job: JobConfig) -> int:
    """Host memory charged for the job's processes: PROCESS_BYTES per rank of its device kind."""
    return job.runtime.workers * PROCESS_BYTES["cuda" if job.runtime.device.startswith("cuda") else "cpu"]


def offload_bytes(job: JobConfig, layout: Layout, step: StepPlan) -> int:
    """The host buffers the ranks page-lock for their offloaded layers' inputs, all ranks: each rank keeps
    every micro-batch's input of each offloaded layer (slidedp/worker/activations.py, [layers, M, m, T, H])."""
    tokens = job.train.global_batch * job.train.seq_len  # every rank's
    return step.offloaded(layout.model.num_layers) * activation_bytes(layout.model, tokens, job.plan.dtype)


def host_need(job: JobConfig, layout: Layout, step: StepPlan, store_exists: bool, shadow: bool,
              device_chunks: tuple[int, ...] = ()) -> HostNeed:
    """What the job takes of the host's memory beyond what is in use now (an existing store is)."""
    world, clip = job.runtime.workers, job.train.max_grad_norm > 0
    slots, reduce_slots, full = gradient_space(layout, world, step.grad_route, clip, job.store.grad_slots,
                                               device_chunks)
    rings = sum(rings_bytes(layout, world, slots, reduce_slots, full, shard_slots=step.grad_route == "reduce_scatter",
                            shard_ranks=job.runtime.world))
    state = 0 if store_exists else sum(held_sizes(layout, {}, shadow, job_part(job)).values())
    per_chunk = clip and not full and slots > ring_slots(job.store.grad_slots, layout.model.num_layers)
    return HostNeed(state, rings, process_bytes(job), world, per_chunk, shadow, offload_bytes(job, layout, step),
                    step.offloaded(layout.model.num_layers))


def held_by_the_job(job: JobConfig, layout: Layout, grad_route: str) -> tuple[StepPlan, tuple[int, ...]]:
    """What every plan of the job holds on the devices, on `grad_route`: the layers and the embedding the
    job file puts there (plan.device_layers, plan.embedding = "device"; none where the plan decides),
    and their chunks, whose gradients stay on the devices and take no ring slot."""
    held = min(job.plan.chosen("device_layers") or 0, layout.model.num_layers)
    step = StepPlan(grad_route=grad_route, device_layers=held, embedding="device" if job.plan.embedding == "device" else "host")
    return step, held_chunk_ids(layout, held_unit_names(layout.model, step))


def unplanned_step(job: JobConfig, layout: Layout) -> tuple[StepPlan, tuple[int, ...]]:
    """The step asked about before the plan, with its held chunks: the job's route (an "auto" route is
    the plan's to pick: until then the host route, whose rings are the larger) and what the job file
    holds on the devices."""
    return held_by_the_job(job, layout, "reduce_scatter" if job.plan.grad_route == "reduce_scatter" else "host")


def unplanned_need(job: JobConfig, layout: Layout, store_exists: bool) -> HostNeed:
    """What any plan of the job takes of the host's memory, asked before the plan: the state to create
    (with the shadow where the job asks for it), the gradient rings of `unplanned_step`, the processes;
    nothing offloaded."""
    step, held = unplanned_step(job, layout)
    return host_need(job, layout, step, store_exists, job.store.shadow_bf16 is True, held)


def room_for_plan(job: JobConfig, layout: Layout, store_exists: bool, available: int) -> HostRoom:
    """What the host's memory leaves for the plan's own choices (offloaded layers' buffers, the bf16
    shadow of a store the job creates) beyond what any plan of the job takes: the fp32 state to create,
    the gradient rings at their largest (every chunk's on the host route, but for those of what the job
    file holds on the devices) and the processes."""
    step, held = held_by_the_job(job, layout, "host")
    base = host_need(job, layout, step, store_exists, shadow=False, device_chunks=held)
    shadow = 0 if store_exists else sum(held_sizes(layout, {}, True, job_part(job)).values()) - base.state  # 2 B/param
    return HostRoom(free_bytes=available - base.total, shadow_bytes=shadow)


def shadow_fits(job: JobConfig, layout: Layout, available: int, shm_free: int) -> bool:
    """Whether the host has room for a store this job creates with the bf16 shadow (14 B/param) and the
    job's gradient rings (on the host route: the larger), in /dev/shm and in the memory available."""
    need = host_need(job, layout, StepPlan(grad_route="host"), store_exists=False, shadow=True).shm_bytes
    return need <= min(shm_free, available)


def room_problem(job: JobConfig, need: HostNeed, available: int, shm_free: int | None = None) -> str | None:
    """None where the host has room; else what the job needs, what the host has, and what would help.
    shm_free: what /dev/shm has free (the store and the rings live there; the processes do not)."""
    if shm_free is not None and need.shm_bytes > shm_free:
        return (f"the job needs {size(need.shm_bytes)} of shared memory ({need.describe()}) but {SHM_DIR} has only "
                f"{size(shm_free)} free; enlarge it (e.g. `mount -o remount,size=<N>G {SHM_DIR}`) or "
                f"choose a smaller model/store")
    if need.total <= available:
        return None
    helps = ["a host with more memory, or other stores destroyed (`slidedp-store list` shows them)"]
    if need.offload:
        helps.append("fewer layers' inputs offloaded (plan.offload_layers, or a larger memory.device_budget_gib "
                     "that keeps them on the device)")
    if need.rings_per_chunk:
        helps.append("more layers held on the device (plan.device_layers, a larger memory.device_budget_gib): "
                     "their gradients stay there")
        helps.append("train.max_grad_norm = 0 keeps a few gradient slots per rank instead, but does not clip "
                     "(it changes the math)")
    return (f"the job needs {size(need.total)} of host memory ({need.describe()}) but the host has "
            f"{size(available)} available: started, it would be killed for memory. What would help: "
            + "; ".join(helps))
