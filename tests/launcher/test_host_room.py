"""The launcher's host-memory check before it makes anything: the store, the gradient rings and the
processes of a job against what the host has available (the numbers of the H200 host where a Qwen3-8B
job with clipping was killed for memory in its first step)."""

from __future__ import annotations

from slidedp.config import load_job
from slidedp.jobrecord import gradient_space
from slidedp.model.config import named_shape
from slidedp.planner import REFERENCE_CALIBRATION, HostRoom, Workload, make_plan
from slidedp.stepplan import StepPlan
from slidedp.store.layout import make_layout
from slidedp.store.rings import rings_bytes
from slidedp.store.store import segment_sizes

from launch.host_room import GiB, PROCESS_BYTES, host_need, room_for_plan, room_problem
from pipeline.harness import TINY

CUDA_8B = ["runtime.device=\"cuda\"", "runtime.workers=1", "train.global_batch=8", "plan.micro_batch=2"]


def _job(extra=()):
    return load_job(TINY, CUDA_8B + list(extra))


def test_a_new_store_with_clipping_counts_state_rings_and_processes():
    job, layout = _job(), make_layout(named_shape("qwen3-8b"))
    need = host_need(job, layout, StepPlan(), store_exists=False, shadow=False)
    slots, reduce_slots, full = gradient_space(layout, 1, "host", True, 0)
    assert slots == len(layout.chunks) and need.rings_per_chunk  # a slot per host chunk
    state = sum(segment_sizes(layout, {}, False).values())
    rings = sum(rings_bytes(layout, 1, slots, reduce_slots, full))
    assert dict(need.items) == {"the store's state (12 B/param)": state,
                                "gradient rings (exact clipping: a slot per host chunk)": rings,
                                "the job's processes (1 rank(s))": PROCESS_BYTES["cuda"]}
    assert 91 * GiB < state < 92 * GiB and 32 * GiB < rings < 33 * GiB  # 45 slots of the largest chunk
    # the H200 host had about 124 GiB available: refused, with what it needs and what would help
    msg = room_problem(job, need, 124 * GiB)
    assert msg is not None and msg.startswith(f"the job needs {need.total / GiB:.1f} GiB of host memory (the store's "
                                              f"state (12 B/param) {state / GiB:.1f} GiB, gradient rings")
    assert "but the host has 124.0 GiB available" in msg and "train.max_grad_norm = 0" in msg
    assert "plan.device_layers" in msg
    assert room_problem(job, need, need.total) is None


def test_an_existing_store_counts_only_what_the_job_adds():
    job, layout = _job(), make_layout(named_shape("qwen3-8b"))
    need = host_need(job, layout, StepPlan(), store_exists=True, shadow=False)
    assert [what for what, _ in need.items] == ["gradient rings (exact clipping: a slot per host chunk)",
                                                "the job's processes (1 rank(s))"]
    # device-held layers keep their gradients on the device: fewer slots
    held = host_need(job, layout, StepPlan(), store_exists=True, shadow=False, device_chunks=(1, 2, 3))
    assert held.total == need.total - 3 * layout.max_chunk_numel * 4


def test_without_clipping_the_rings_are_a_few_slots_and_the_advice_says_nothing_of_them():
    job, layout = _job(["train.max_grad_norm=0"]), make_layout(named_shape("qwen3-8b"))
    need = host_need(job, layout, StepPlan(), store_exists=False, shadow=True)
    assert not need.rings_per_chunk and "the store's state (14 B/param)" in dict(need.items)
    # a third of the 36 layers: 12 slots of the largest chunk
    assert dict(need.items)["gradient rings"] == sum(rings_bytes(layout, 1, 12, 0, False)) < 9 * GiB
    msg = room_problem(job, need, need.total - 1)
    assert msg is not None and "max_grad_norm" not in msg and "a host with more memory" in msg


def test_a_dev_shm_too_small_for_the_store_and_rings_is_named():
    job, layout = _job(), make_layout(named_shape("qwen3-8b"))
    need = host_need(job, layout, StepPlan(), store_exists=False, shadow=False)
    shm = need.total - PROCESS_BYTES["cuda"]
    msg = room_problem(job, need, 10 * need.total, shm_free=shm - 1)
    assert msg == (f"the job needs {shm / GiB:.1f} GiB of shared memory ({need.describe()}) but /dev/shm has only "
                   f"{(shm - 1) / GiB:.1f} GiB free; enlarge it (e.g. `mount -o remount,size=<N>G /dev/shm`) or "
                   f"choose a smaller model/store")
    assert room_problem(job, need, 10 * need.total, shm_free=shm) is None  # the processes are not in /dev/shm


def test_offloaded_layer_inputs_are_counted_beside_the_store():
    # Qwen3-8B at 32 x 2,048 with the first 20 layers' inputs offloaded, as the H200 plan chose: 20 x 32 x 2,048
    # x 4,096 bf16 values, the 10.0 GiB the harness saw the job's host memory grow by
    job = _job(["train.max_grad_norm=0", "train.global_batch=32", "plan.micro_batch=8", "train.seq_len=2048",
                'plan.compute_dtype="bf16"'])
    layout = make_layout(named_shape("qwen3-8b"))
    need = host_need(job, layout, StepPlan(offload_layers=20), store_exists=True, shadow=False)
    assert dict(need.items)["offloaded inputs of 20 layer(s)"] == 20 * 32 * 2048 * 4096 * 2
    assert need.total == need.shm_bytes + 20 * 32 * 2048 * 4096 * 2 + PROCESS_BYTES["cuda"]
    assert need.shm_bytes == dict(need.items)["gradient rings"]  # the buffers are the processes', not /dev/shm's
    msg = room_problem(job, need, need.total - 1)
    assert msg is not None and "offloaded inputs of 20 layer(s) 10.0 GiB" in msg and "plan.offload_layers" in msg
    # nothing offloaded: no such item
    assert "offloaded" not in " ".join(w for w, _ in host_need(job, layout, StepPlan(), True, False).items)


def test_the_plan_is_told_what_the_host_leaves_for_offloaded_inputs_and_the_shadow():
    # the Qwen3-8B job at 32 x 2,048, no clipping, creating its store on a host with 123.6 GiB available
    # (a plan of the shadow and 19 offloaded layers needed 132.9 GiB of it and was refused at launch)
    job = _job(["train.max_grad_norm=0", "train.global_batch=32", "plan.micro_batch=auto", "train.seq_len=2048",
                'plan.compute_dtype="bf16"'])
    layout = make_layout(named_shape("qwen3-8b"))
    available = int(123.6 * GiB)
    room = room_for_plan(job, layout, store_exists=False, available=available)
    base = host_need(job, layout, StepPlan(grad_route="host"), store_exists=False, shadow=False)
    shadowed = host_need(job, layout, StepPlan(grad_route="host"), store_exists=False, shadow=True)
    assert room == HostRoom(free_bytes=available - base.total, shadow_bytes=shadowed.state - base.state)
    assert room.shadow_bytes == 2 * layout.model.num_parameters() and 15 * GiB < room.free_bytes < 16 * GiB
    # an existing store: its state is in use already, and its shadow (or none) is what it is
    kept = room_for_plan(job, layout, store_exists=True, available=available)
    assert kept == HostRoom(free_bytes=available - base.total + base.state, shadow_bytes=0)
    # what the planner makes of it at a 24 GiB budget: the plan's host need fits what is available
    work = Workload(named_shape("qwen3-8b"), global_batch=32, seq_len=2048, world=1, micro_batch=0, clip=False,
                    compiled=True, host_room=room)
    plan = make_plan(work, 24 * GiB, REFERENCE_CALIBRATION, {"activations": ("keep", "offload")})
    need = host_need(job, layout, plan.step, store_exists=False, shadow=plan.step.delivery == "bf16")
    assert room_problem(job, need, available) is None


def test_what_the_job_file_holds_on_the_devices_takes_no_ring_slot_before_the_plan():
    """The refusal's advice names plan.device_layers (their gradients stay on the device): the check
    before the plan and the room the planner is told count the rings without the slots of what the job
    file holds there, so following the advice can lift the refusal. The Qwen3-8B job with clipping on a
    host with 124 GiB available: refused as it is; 12 layers held take 12 of its 45 slots off and fit."""
    from launch.host_room import unplanned_need

    layout = make_layout(named_shape("qwen3-8b"))
    slot = layout.max_chunk_numel * 4  # a chunk's fp32 gradient
    plain, held = _job(), _job(["plan.device_layers=12"])
    embed = _job(['plan.embedding="device"'])
    need, need_held, need_embed = (unplanned_need(j, layout, store_exists=False) for j in (plain, held, embed))
    assert need == host_need(plain, layout, StepPlan(grad_route="host"), store_exists=False, shadow=False)
    assert need.total - need_held.total == 12 * slot  # one chunk a layer
    assert need.total - need_embed.total == 8 * slot  # the untied embedding's and head's row chunks
    available = 124 * GiB
    assert "plan.device_layers" in room_problem(plain, need, available)
    assert room_problem(held, need_held, available) is None
    # the planner is told the same room: what the held layers' slots free is room for its own choices
    assert (room_for_plan(held, layout, False, available).free_bytes
            - room_for_plan(plain, layout, False, available).free_bytes) == 12 * slot
