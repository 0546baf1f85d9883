"""The launcher's one decision on a job (launch/admission.py), driven with hand-built facts: whether the
store holds the job's layout, whether the host has room before and after the plan, the bf16 shadow, the
plan, the resume point; and one job for which the dry run and the launcher reach the same decision."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from slidedp.config import load_job, model_config
from slidedp.launch import dryrun, jobrun
from slidedp.launch.admission import (Admission, AdmissionFacts, CheckpointFacts, Finding, HostFacts, StoreFacts,
                                      admit)
from slidedp.launch.host_room import GiB, host_need, room_problem, unplanned_need
from slidedp.model.config import named_shape
from slidedp.planner import REFERENCE_CALIBRATION, Calibration
from slidedp.data import setup as data_setup
from slidedp.stepplan import StepPlan
from slidedp.store import shm
from slidedp.store.client import call
from slidedp.store.layout import make_layout
from slidedp.store.store import HostStore

from pipeline.harness import TINY, unique_store

PLENTY = HostFacts(available=1 << 40, shm_free=1 << 40)  # a host with a TiB of memory and /dev/shm free
TINY_LAYOUT = make_layout(named_shape("tiny", 512))  # examples/tiny.toml's model
# Qwen3-8B on one GPU, bf16, PCIe slow and the host plentiful: the planner takes the bf16 delivery where it can
Q8 = ['model.shape="qwen3-8b"', "model.vocab_size=0", "train.seq_len=2048", "train.global_batch=8",
      "plan.micro_batch=2", 'plan.compute_dtype="bf16"', 'runtime.device="cuda"', "runtime.workers=1",
      "memory.device_budget_gib=24"]
PCIE_BOUND = dataclasses.replace(REFERENCE_CALIBRATION, h2d_gbps=6.0, d2h_gbps=6.0, bidir_gbps=12.0,
                                 host_copy_gbps=2000.0, adamw_params_per_s=1e12)


def facts(*sets: str, store: StoreFacts = StoreFacts(), host: HostFacts = PLENTY, **more) -> AdmissionFacts:
    job = load_job(TINY, list(sets))
    return AdmissionFacts(job, model_config(job), store, host, **more)


def existing(layout=TINY_LAYOUT, **fields) -> StoreFacts:
    """A store of `layout` as its status or manifest describes it."""
    return StoreFacts(**{**dict(exists=True, source="random:tiny", parameters=layout.num_parameters,
                                layout_hash=layout.hash(), model_config=layout.model.to_dict(),
                                chunk_rows=layout.chunk_rows), **fields})


def test_a_job_that_fits_a_new_store():
    f = facts()
    a = admit(f)
    assert a.problems == () and a.problem is None and a.warnings == ()
    assert a.layout == TINY_LAYOUT and a.matches and not a.store_exists
    assert a.plan is not None and a.plan.plan is None  # CPU: the job file's values, no planner
    assert (a.plan.step.micro_batch, a.plan.step.delivery, a.shadow) == (2, "fp32", False)
    assert a.device_chunks == () and (a.resume, a.start) == (None, 0)


def test_admit_reads_nothing_of_the_host(monkeypatch):
    """Every number comes from the facts: a host that could not be asked changes nothing."""

    def refuse(*_):
        raise AssertionError("admit asked the host")

    monkeypatch.setattr(psutil, "virtual_memory", refuse)
    monkeypatch.setattr(shm, "shm_free_bytes", refuse)
    assert admit(facts()).problem is None


def test_another_model_in_the_store_is_refused_naming_the_fields():
    llama = make_layout(named_shape("tiny-llama", 512))
    a = admit(facts('store.name="other"', store=existing(llama, source="random:tiny-llama", committed_step=3)))
    assert not a.matches and a.plan is None and a.start == 3
    assert a.problems == (Finding("store", (
        f"store 'other' holds another model (random:tiny-llama, {llama.num_parameters:,} parameters) than this job "
        f"(random:tiny): family: store 'llama', job 'qwen3'; intermediate_size: store 160, job 128; qk_norm: store "
        f"False, job True; tie_word_embeddings: store False, job True; set store.name to another store, or destroy it "
        f"with `slidedp-store destroy other`")),)
    # the same model in another chunking: the hash differs, the fields do not
    rows = existing(chunk_rows=TINY_LAYOUT.chunk_rows // 2, layout_hash="0" * 64)
    assert f"chunk_rows: store {TINY_LAYOUT.chunk_rows // 2}, job {TINY_LAYOUT.chunk_rows}" in admit(
        facts(store=rows)).problem


def test_no_room_before_the_plan_names_what_the_job_needs_and_makes_no_plan():
    job = load_job(TINY, [])
    need = unplanned_need(job, TINY_LAYOUT, store_exists=False)
    # memory: the store and rings fit, the two CPU ranks' 2 GiB do not
    host = HostFacts(available=3 * 2**29, shm_free=1 << 40)
    a = admit(facts(host=host))
    assert a.plan is None and a.problems == (Finding("store", room_problem(job, need, host.available)),)
    assert a.problem.startswith("the job needs 2.0 GiB of host memory (the store's state (12 B/param) 1.2 MiB, "
                                "gradient rings 1.3 MiB, the job's processes (2 rank(s)) 2.0 GiB) but the host has "
                                "1.5 GiB available: started, it would be killed for memory. What would help: ")
    # /dev/shm too small for the store and its rings
    a = admit(facts(host=HostFacts(available=1 << 40, shm_free=2 * 2**20)))
    assert a.plan is None and a.problem == (
        f"the job needs 2.5 MiB of shared memory ({need.describe()}) but /dev/shm has only 2.0 MiB free; enlarge it "
        f"(e.g. `mount -o remount,size=<N>G /dev/shm`) or choose a smaller model/store")
    # an existing store's state is in use already: only its rings and the processes are asked for
    assert admit(facts(store=existing(), host=HostFacts(need.total - need.state, 1 << 40))).problem is None


def test_no_room_for_the_planned_job_is_found_after_the_plan():
    """Room for what any plan takes, not for the plan's offloaded layers' buffers: refused in the host's topic."""
    sets = ("plan.offload_layers=2",)
    job = load_job(TINY, list(sets))
    need = host_need(job, TINY_LAYOUT, StepPlan(offload_layers=2), store_exists=False, shadow=False)
    offload = dict(need.items)["offloaded inputs of 2 layer(s)"]
    host = HostFacts(available=need.total - offload // 2, shm_free=1 << 40)
    a = admit(facts(*sets, host=host))
    assert a.plan is not None and a.plan.step.offload_layers == 2
    assert a.problems == (Finding("host", room_problem(job, need, host.available)),)
    assert "plan.offload_layers" in a.problem
    assert admit(facts(*sets, host=HostFacts(need.total, 1 << 40))).problem is None


@pytest.mark.parametrize("sets, store, shadow", [
    ((), StoreFacts(), False),  # store.shadow_bf16 = "auto" on the CPU: fp32, none
    (("store.shadow_bf16=true",), StoreFacts(), True),  # asked for: a new store gets it
    (('plan.compute_dtype="bf16"', "store.shadow_bf16=true"), StoreFacts(), True),
    ((), existing(shadow=True), True),  # an existing store's is what it is
    (('plan.compute_dtype="bf16"',), existing(shadow=True), True),
])
def test_the_shadow_on_the_cpu(sets, store, shadow):
    a = admit(facts(*sets, store=store))
    assert a.problem is None and a.shadow is shadow and a.plan.shadow is shadow


def test_the_existing_stores_shadow_wins_over_the_job_file():
    a = admit(facts("store.shadow_bf16=true", store=existing(shadow=False)))
    assert a.problem is None and a.shadow is False
    assert a.warnings == (Finding("store", "store.shadow_bf16 = true but the existing store was made without the bf16 "
                                           "shadow; the store's wins"),)
    # bf16 delivery asked of a store without the shadow: refused, saying what to change
    a = admit(facts('plan.compute_dtype="bf16"', 'plan.delivery="bf16"', 'store.name="s"', store=existing()))
    assert a.plan is None and a.problems[0].topic == "plan" and a.problem.startswith(
        "plan.delivery = \"bf16\" streams the store's bf16 shadow, but store 's' was created without one: ")


def test_the_shadow_where_the_plan_delivers_bf16_and_where_the_host_has_no_room_for_it():
    job = load_job(TINY, Q8)
    layout = make_layout(model_config(job))
    a = admit(facts(*Q8, gpus=1, calibration=PCIE_BOUND))
    assert a.problem is None and a.plan.plan is not None
    assert (a.plan.step.delivery, a.shadow) == ("bf16", True)  # the store this job creates gets the shadow
    # /dev/shm with room for the store and its rings, not for its 2 B/param of shadow besides
    with_shadow = host_need(job, layout, StepPlan(grad_route="host"), store_exists=False, shadow=True).shm_bytes
    a = admit(facts(*Q8, gpus=1, calibration=PCIE_BOUND, host=HostFacts(1 << 40, with_shadow - 1)))
    assert a.problem is None and (a.plan.step.delivery, a.shadow) == ("fp32", False)
    assert a.plan.notes == ("delivery fp32: the host has no room for the bf16 shadow (2 B/param more host memory) "
                            "beside the store; store.shadow_bf16 = true asks for it",)
    # an existing store without the shadow: fp32, whatever the plan would have liked
    a = admit(facts(*Q8, gpus=1, calibration=PCIE_BOUND, store=existing(layout, shadow=False)))
    assert a.problem is None and (a.plan.step.delivery, a.shadow) == ("fp32", False)


def test_the_gpus_and_a_plan_that_does_not_fit():
    a = admit(facts(*Q8, gpus=0, calibration=PCIE_BOUND))
    assert a.plan is None and a.problems == (
        Finding("plan", "runtime.device = \"cuda\" but no CUDA device is visible to this process"),)
    a = admit(facts(*Q8, "runtime.workers=2", gpus=1, calibration=PCIE_BOUND))
    assert a.problem is None and a.warnings == (Finding("plan", "2 ranks share 1 GPU(s)"),)
    small = Calibration(host="test", device_name="H200 (synthetic)", h2d_gbps=50.0, d2h_gbps=50.0, bidir_gbps=80.0,
                        adamw_params_per_s=2e9, adamw_threads=32, reduce_gbps=20.0, device_tflops=400.0,
                        device_mem_bytes=140 * GiB)
    a = admit(facts(*Q8, "memory.device_budget_gib=1.0", gpus=1, calibration=small))
    assert a.plan is None and a.problems[0].topic == "plan"
    assert a.problem.startswith("no plan fits the GPU memory budget of 1.00 GiB: the smallest plan needs ")


def test_the_resume_point():
    at7 = existing(committed_step=7)
    # nothing asked: the store's committed step (a new store's is 0)
    assert [(a.resume, a.start) for a in (admit(facts(store=at7)), admit(facts()))] == [(None, 7), (None, 0)]
    # "latest" and no valid checkpoint: the store's step
    a = admit(facts('checkpoint.resume="latest"', store=at7))
    assert a.problem is None and (a.resume, a.start) == (None, 7)
    # a checkpoint of this model: restored, the job starts at its step
    ck = CheckpointFacts(Path("/ck/step-00000005"), 5, TINY_LAYOUT.hash(), "qwen3")
    a = admit(facts('checkpoint.resume="latest"', store=at7, checkpoint=ck))
    assert a.problem is None and (a.resume, a.start) == (ck.path, 5)
    # another model's: refused
    other = dataclasses.replace(ck, layout_hash="0" * 64, family="llama")
    a = admit(facts('checkpoint.resume="latest"', checkpoint=other))
    assert a.plan is not None and (a.resume, a.start) == (None, 0)  # the plan is made: the run refuses at the first
    assert a.problems == (Finding("resume", "checkpoint /ck/step-00000005 was taken from another model or chunking "
                                            "than this job's (llama); choose a checkpoint of this model"),)
    # its data position is not where this data is at its step
    moved = dataclasses.replace(ck, data_problem="the checkpoint's data position ... does not match")
    a = admit(facts('checkpoint.resume="latest"', checkpoint=moved))
    assert a.problem == "cannot resume from /ck/step-00000005: the checkpoint's data position ... does not match"
    # a torn store and nothing to restore
    a = admit(facts('checkpoint.resume="latest"', 'store.name="s"', 'checkpoint.dir="/ck"',
                    store=existing(torn="a restore into it did not finish")))
    assert a.problem == ("store 's' is torn (a restore into it did not finish) and /ck holds no valid checkpoint to "
                         "restore; destroy the store or name a checkpoint in checkpoint.resume")


def test_a_run_stops_at_the_first_problem_in_the_order_it_meets_them():
    llama = make_layout(named_shape("tiny-llama", 512))
    other = CheckpointFacts(Path("/ck/step-00000001"), 1, llama.hash(), "llama")
    a = admit(facts('checkpoint.resume="latest"', store=existing(llama), checkpoint=other))
    assert [f.topic for f in a.problems] == ["store", "resume"] and "holds another model" in a.problem


def test_the_checkpoints_data_position_is_checked_against_the_jobs_data():
    job = load_job(TINY, [])
    batches = data_setup.open_training(job, 512)
    record = {"step": 4, "layout_hash": TINY_LAYOUT.hash(), "model": {"family": "qwen3"},
              "extra": {"data": batches.state(4)}}
    assert CheckpointFacts.of(Path("/ck"), record, batches) == CheckpointFacts(Path("/ck"), 4, TINY_LAYOUT.hash(), "qwen3")
    record["extra"]["data"] = dict(batches.state(4), seed=5)
    assert "does not match" in CheckpointFacts.of(Path("/ck"), record, batches).data_problem


def test_the_dry_run_and_the_launcher_reach_the_same_admission(tmp_path, monkeypatch):
    """One job on an existing store, resuming from its checkpoint: the dry run reads the store's manifest, the
    launcher asks its daemon (here served in this process); both gather the same facts and admit the same."""
    store = unique_store("admit")
    seen: dict[str, tuple[AdmissionFacts, Admission]] = {}

    class Seen(Exception):
        pass

    def recorder(who: str, stop: bool):
        def record(f: AdmissionFacts) -> Admission:
            seen[who] = (f, admit(f))
            if stop:  # the launcher: nothing past the decision (no daemons here to attach to)
                raise Seen()
            return seen[who][1]
        return record

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=64 * GiB))
    monkeypatch.setattr(dryrun, "shm_free_bytes", lambda: 32 * GiB)
    monkeypatch.setattr(jobrun, "shm_free_bytes", lambda: 32 * GiB)
    monkeypatch.setattr(dryrun, "admit", recorder("dry run", stop=False))
    monkeypatch.setattr(jobrun, "admit", recorder("launcher", stop=True))
    monkeypatch.setattr(jobrun.children, "start_daemons", lambda *a, **k: [])
    try:
        st = HostStore.create(store, TINY_LAYOUT, {"source": "random:tiny"})
        st.manifest.set_committed_step(3)
        st.manifest.versions[:] = 3
        st.close()
        sets = [f'store.name="{store}"', f'run.dir="{tmp_path / "run"}"', 'checkpoint.resume="latest"']
        job = load_job(TINY, sets)
        data = data_setup.open_training(job, 512).state(3)
        ck = call(store, "checkpoint", timeout_s=60, dir=str(job.checkpoint_dir), dtype="fp32", keep=2,
                  extra={"data": data})["path"]
        st = HostStore.attach(store)  # trained on past it: the checkpoint, not the store, says where to start
        st.manifest.set_committed_step(5)
        st.manifest.versions[:] = 5
        st.close()
        out = io.StringIO()
        assert dryrun.dry_run(job, TINY, out) == 0, out.getvalue()
        run = jobrun.JobRun(job, TINY)
        try:
            with pytest.raises(Seen):
                run.prepare()
        finally:
            run.teardown(failed=True)
    finally:
        shm.unlink_store(store)
    (dry_facts, dry), (run_facts, launched) = seen["dry run"], seen["launcher"]
    assert dry_facts == run_facts and dry == launched
    assert dry.problem is None and dry.store_exists and run_facts.store.committed_step == 5
    assert (dry.resume, dry.start) == (Path(ck), 3)
    assert f"resume     {ck}: step 3, files verified; would restore it into the store" in out.getvalue()


def test_a_store_of_another_layer_cut_is_refused_naming_both():
    """plan.layer_chunk_numel is part of the job's layout: a store of whole layers does not serve a job that
    cuts them, and one cut so does."""
    cut = make_layout(named_shape("tiny", 512), layer_chunk_numel=5000)
    assert cut.layer_chunk_numel == 5000 and len(cut.layer_chunks(0)) > 1
    a = admit(facts("plan.layer_chunk_numel=5000", store=existing(layer_chunk_numel=0)))
    assert not a.matches and a.layout == cut
    assert ("layer_chunk_numel: store 0 (one chunk a layer), job 5,000 (layers cut into chunks of at most that many "
            "elements) (plan.layer_chunk_numel)") in a.problem
    ok = admit(facts("plan.layer_chunk_numel=5000", store=existing(cut, layer_chunk_numel=5000)))
    assert ok.problem is None and ok.matches and ok.plan.step.layer_chunk_numel == 5000
    assert admit(facts("plan.layer_chunk_numel=0")).layout == TINY_LAYOUT  # whole layers: the dense default


HOSTS = ["runtime.nnodes=2", "runtime.node_rank=1", 'runtime.master_addr="10.0.0.1"', "runtime.workers=2",
         "checkpoint.final=false", "train.global_batch=8"]


def test_a_host_of_several_needs_its_own_part_of_the_state():
    """On several hosts a job takes a store holding its host's part; a whole store, or another host's part,
    is refused naming both; the state it would create is the part's, a third of the whole here."""
    from slidedp.store.part import StorePart

    mine = StorePart(2, 1, 2)
    assert admit(facts(*HOSTS, store=existing(part=mine.to_dict()))).problem is None
    for held, what in ((None, "every range of the state (one host)"),
                       (StorePart(2, 0, 2).to_dict(), "the ranges of host 0 of 2 (2 rank(s) each)")):
        a = admit(facts(*HOSTS, store=existing(part=held)))
        assert not a.matches
        assert a.problem == (f"store {load_job(TINY, HOSTS).store_name!r} holds {what}, and this "
                                  "job needs the ranges of host 1 of 2 (2 rank(s) each) (runtime.nnodes, node_rank, "
                                  "workers); give each host's job its own store (store.name), or destroy this one "
                                  f"with `slidedp-store destroy {load_job(TINY, HOSTS).store_name}`")
    one = unplanned_need(load_job(TINY, ["runtime.workers=2"]), TINY_LAYOUT, False).state
    part = unplanned_need(load_job(TINY, HOSTS), TINY_LAYOUT, False).state
    assert part < 0.55 * one  # manifest aside, half of the fp32 state
