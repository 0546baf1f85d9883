"""The central test: N ranks x M micro-batches give exactly the update of the plain PyTorch reference.

fp32 on CPU, 5 steps, real processes (daemons, workers), real shared memory and sockets.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from slidedp.config import load_job, model_config
from slidedp.data.batches import open_batches
from slidedp.model import hf
from slidedp.model.config import named_shape
from slidedp.model.init import init_params
from slidedp.reference import initial_params, train_reference

from .harness import (TINY, Launched, checkpoint_weights, launch, launch_once, metrics, rel_err, store_segments,
                      unique_store)

GLOBAL_BATCH = 12
STEPS = 5

# (workers, micro-batches per rank, clipping, model shape): every workers x micro-batches pair,
# clipping on and off, tied (Qwen3) and untied (Llama) embeddings.
# The last column: the embedding (and an untied head) held by the workers ("device", all-reduced
# among ranks, AdamW in the worker) or on the host; and layers kept from forward to backward.
# The default suite runs two of the nine (with ROUTE_CASES: every rank count 1-4, micro-batch count 1, 2
# and 4, each shape, embedding and clipping); the rest wait for -m slow (the suite's time on 2 cores).
SLOW_CASES = [(1, 1, 0.5, "tiny", "host"), (1, 4, 0.5, "tiny-llama", "host"), (2, 1, 0.0, "tiny", "host"),
              (3, 1, 0.5, "tiny-llama", "device"), (3, 2, 0.0, "tiny", "device"), (2, 2, 0.5, "tiny", "device"),
              (2, 4, 0.0, "tiny-llama", "host")]
CASES = [(1, 2, 0.0, "tiny-llama", "device"), (3, 4, 0.5, "tiny", "host")]

# The sharded routes (gloo among CPU ranks): parameters all-gathered, gradients reduce-scattered,
# each alone and together; 3 ranks cut chunks into uneven shards (the last one short).
# The last column: sequence tiles of 24 tokens (across the 2 sequences of a micro-batch) and
# the first layers' saved inputs held in host memory.
TILED = ("plan.seq_tile_tokens=24", "plan.offload_layers=1")
ROUTE_CASES = [
    # both sharded routes with clipping (-m slow: the suite's time; the tiled and the held-layer cases below clip on them)
    pytest.param(2, 2, 0.5, "tiny", "host", "sharded", "reduce_scatter", (), marks=pytest.mark.slow),
    (3, 1, 0.0, "tiny-llama", "device", "sharded", "host", ()),
    (3, 2, 0.0, "tiny-llama", "host", "replicated", "reduce_scatter", ()),  # shards updated in the ranks' slots
    (3, 1, 0.5, "tiny", "host", "sharded", "reduce_scatter", TILED),
    (4, 1, 0.0, "tiny-llama", "host", "sharded", "reduce_scatter", ()),  # four ranks, as on a 4-GPU host
    (2, 2, 0.5, "tiny-llama", "device", "replicated", "host", TILED),
    # the first layers held by the workers with their AdamW state (updated there, all-reduced among
    # ranks): one of two with clipping (-m slow: the suite's time; test_held_layers_carry_over_to_the_next_job
    # holds one with clipping on one rank), both of two (every layer) beside a device embedding, and
    # beside the sharded routes
    pytest.param(1, 2, 0.5, "tiny", "host", "replicated", "host", ("plan.device_layers=1",), marks=pytest.mark.slow),
    (2, 2, 0.0, "tiny-llama", "device", "replicated", "host", ("plan.device_layers=2",)),
    (3, 1, 0.5, "tiny", "host", "sharded", "reduce_scatter", ("plan.device_layers=1",)),
]


def job_sets(workers: int, micro: int, clip: float, shape: str, store: str, run_dir, embedding: str = "host",
             param_route: str = "replicated", grad_route: str = "host") -> list[str]:
    return [
        f'plan.param_route="{param_route}"', f'plan.grad_route="{grad_route}"',
        f'plan.embedding="{embedding}"', f"plan.resident_layers={1 if embedding == 'device' else 0}",
        f"train.steps={STEPS}", f"train.global_batch={GLOBAL_BATCH}",
        f"plan.micro_batch={GLOBAL_BATCH // (workers * micro)}", f"train.max_grad_norm={clip}",
        "train.warmup_steps=2", "train.weight_decay=0.1", "plan.compute_dtype=\"fp32\"",
        f"model.shape=\"{shape}\"", f"runtime.workers={workers}", f"store.name=\"{store}\"",
        f"run.dir=\"{run_dir}\"", "checkpoint.dtype=\"fp32\"",
    ]


_reference_cache: dict = {}


def reference(sets: list[str]):
    key = tuple(s for s in sets if not s.startswith(("runtime.", "plan.", "store.name", "run.dir", "memory.")))
    if key not in _reference_cache:
        job = load_job(TINY, sets)
        cfg = model_config(job)
        _reference_cache[key] = train_reference(job, initial_params(job), open_batches(job, cfg.vocab_size), steps=STEPS)
    return _reference_cache[key]


def launched(tmp_path_factory, workers: int, micro: int, clip: float, shape: str, embedding: str = "host",
             param_route: str = "replicated", grad_route: str = "host", extra: tuple[str, ...] = ()) -> Launched:
    """(proc, run_dir, sets, store) of the job of these values, launched once per session with INFO logs (the
    workers' start-up lines name their routes): the shared-memory test reads the 4-rank run that
    test_matches_reference checks, whichever of them runs first."""
    def sets_for(store: str, run_dir) -> list[str]:
        return job_sets(workers, micro, clip, shape, store, run_dir, embedding, param_route, grad_route) + list(extra)

    key = ("eq", workers, micro, clip, shape, embedding, param_route, grad_route, tuple(extra))
    return launch_once(key, tmp_path_factory, sets_for, env={"SLIDEDP_LOG_LEVEL": "INFO"})


@pytest.mark.parametrize("workers,micro,clip,shape,embedding,param_route,grad_route,extra",
                         [c + ("replicated", "host", ()) for c in CASES] + ROUTE_CASES
                         + [pytest.param(*c, "replicated", "host", (), marks=pytest.mark.slow) for c in SLOW_CASES])
def test_matches_reference(tmp_path_factory, workers, micro, clip, shape, embedding, param_route,
                           grad_route, extra):
    proc, run_dir, sets, store = launched(tmp_path_factory, workers, micro, clip, shape, embedding,
                                          param_route, grad_route, extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(workers):  # each rank says which routes it runs
        assert f"rank {rank}/{workers} on cpu" in proc.stderr + proc.stdout
        depth = next((e.split("=")[1] for e in extra if "prefetch_depth" in e), "1")
        assert f"params {param_route} ({depth} ahead), grads {grad_route}" in proc.stderr + proc.stdout
        assert ("seq tiles of 24 tokens, 1 layer(s) offloaded" if extra == TILED else "untiled, 0 layer(s) offloaded") \
            in proc.stderr + proc.stdout
        held = [f"layer.{i}" for i in range(int(next((e.split("=")[1] for e in extra if "device_layers" in e), 0)))]
        held += (["embed"] + ([] if shape == "tiny" else ["head"])) if embedding == "device" else []
        assert f"held on the device: {', '.join(held) or 'nothing'}" in proc.stderr + proc.stdout
    assert_matches_reference(run_dir, sets)
    assert store_segments(store) == []  # the job created the store and did not persist it


# float32 rounding, relative: the engine sums micro-batches and ranks in another order than the
# reference's whole batch (and gloo's ring sums shards in yet another), AdamW's 1/sqrt(v) magnifies
# those last-bit differences where a gradient is near zero, and each step carries them into the next
# step's gradients. Over STEPS steps they reach about 1.3e-5 on some hosts' CPU kernels.
ROUNDING = 3e-5


def assert_matches_reference(run_dir, sets: list[str], bound: float = ROUNDING) -> None:
    """The run's losses, gradient norms and final weights (relative, per tensor) against the reference
    trainer's, to float32 rounding (`bound`)."""
    ref = reference(sets)
    got = metrics(run_dir)
    assert [m["step"] for m in got] == list(range(STEPS))
    for m, want in zip(got, ref.losses):
        assert abs(m["loss"] - want) <= bound * abs(want), (m["loss"], want)
    for m, want in zip(got, ref.grad_norms):
        assert abs(m["grad_norm"] - want) <= bound * want, (m["grad_norm"], want)
    weights = checkpoint_weights(run_dir / "checkpoints" / f"step-{STEPS:08d}")
    assert set(weights) == set(ref.params)
    worst = max((rel_err(weights[n], ref.params[n]), n) for n in ref.params)
    assert worst[0] < bound, worst


@pytest.mark.parametrize("workers,extra", [
    pytest.param(2, ("plan.prefetch_depth=3",), marks=pytest.mark.slow),  # -m slow: the suite's time
    (2, ("plan.prefetch_depth=2", "plan.device_layers=2")),
])
def test_deeper_prefetch_on_the_sharded_routes_matches_reference(tmp_path, monkeypatch, workers, extra):
    """Copies and all-gathers running 2-3 layers ahead among gloo ranks (beside 2 device-held layers),
    on a 6-layer model from a checkpoint folder: the named tiny shapes have 2 layers, where no copy
    runs more than one ahead. Two ranks: a sum of two is the same in any order (with 3 ranks on this
    model gloo's order alone moves the gradient norm by 1.2e-5 at depth 1 as well)."""
    monkeypatch.setenv("SLIDEDP_LOG_LEVEL", "INFO")  # the workers' start-up lines name the depth
    cfg = replace(named_shape("tiny"), num_layers=6)
    folder = tmp_path / "six-layers"
    hf.write_folder(folder, cfg, init_params(cfg, 3), dtype=torch.float32)
    run_dir = tmp_path / "run"
    sets = job_sets(workers, 1, 0.5, "tiny", unique_store("deep"), run_dir, "host", "sharded", "reduce_scatter")
    sets += ['model.source="hf"', f'model.path="{folder}"', "model.vocab_size=0", *extra]
    proc = launch(TINY, *sets, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    depth = extra[0].split("=")[1]
    assert f"params sharded ({depth} ahead), grads reduce_scatter" in proc.stderr + proc.stdout
    assert_matches_reference(run_dir, sets)


@pytest.mark.parametrize("workers,shape,embedding,routes", [
    (1, "tiny-llama", "device", ("replicated", "host")),
    pytest.param(2, "tiny", "host", ("sharded", "reduce_scatter"), marks=pytest.mark.slow),  # -m slow: time
])
def test_held_layers_carry_over_to_the_next_job(tmp_path, workers, shape, embedding, routes):
    """Device-held layers live on the workers for a job: the first job writes them (master and AdamW
    moments) back to the persistent store at its end, the next one leases them again from its
    committed step. Two jobs of 2 and 3 steps equal one job of 5."""
    from slidedp.store.shm import unlink_store  # noqa: PLC0415

    store = unique_store("carry")
    ref = None
    try:
        for first, last in ((0, 2), (2, STEPS)):
            run_dir = tmp_path / f"run-{last}"
            sets = job_sets(workers, 1, 0.5, shape, store, run_dir, embedding, *routes)
            # a constant rate after warm-up: a cosine's span is the job's train.steps
            sets += ["plan.device_layers=1", "store.persist=true", f"train.steps={last}", 'train.schedule="constant"']
            proc = launch(TINY, *sets, cwd=tmp_path)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            ref = ref or reference(sets)
            got = metrics(run_dir)
            assert [m["step"] for m in got] == list(range(first, last))
            # only the job's last step wrote the held units back to the store, and its record says how long
            assert [m["write_back_s"] > 0 for m in got] == [m["step"] == last - 1 for m in got]
            for m in got:
                want = ref.losses[m["step"]]
                assert abs(m["loss"] - want) <= 1e-5 * abs(want), (m["step"], m["loss"], want)
        weights = checkpoint_weights(tmp_path / f"run-{STEPS}" / "checkpoints" / f"step-{STEPS:08d}")
        worst = max((rel_err(weights[n], ref.params[n]), n) for n in ref.params)
        assert worst[0] < 2e-5, worst
    finally:
        unlink_store(store)


def test_shared_memory_is_one_copy_whatever_the_ranks(tmp_path_factory):
    """One copy of the state for any number of ranks, and on the reduce-scattered route each rank's
    gradient slots hold its shard: 4 ranks take the shared memory of 1, but for the shards' padding
    (a chunk of n elements cut in 4 shards of ceil(n / 4): at most 3 elements per slot). The 4-rank
    run is test_matches_reference's (4 ranks, sharded, reduce-scattered, tiny-llama), launched once."""
    from slidedp.jobrecord import ring_slots

    shm = {}
    for workers in (1, 4):
        proc, run_dir, _, _ = launched(tmp_path_factory, workers, 1, 0.0, "tiny-llama", "host", "sharded",
                                       "reduce_scatter")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        got = {m["shm_bytes"] for m in metrics(run_dir)}
        assert len(got) == 1, got  # the same through the job
        shm[workers] = got.pop()
    slots = ring_slots(0, model_config(load_job(TINY, ['model.shape="tiny-llama"'])).num_layers)
    assert 0 <= shm[4] - shm[1] <= slots * 3 * 4, shm
