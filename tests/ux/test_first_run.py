"""A newcomer's first runs: a CUDA job on a host without CUDA fails first, a run ends with a summary and
leaves nothing under the socket root, Ctrl-C stops cleanly with a non-zero exit status, and a store
trained further says what its learning-rate schedule will do."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import torch

from slidedp.config import job_to_dict, load_job
from slidedp.launch import cli
from slidedp.paths import resolve_run_dir
from slidedp.store.client import call
from slidedp.store.shm import list_store_segments
from slidedp.store.store import HostStore

from pipeline.harness import TINY, unique_store
from reliability import RunningJob, drop_store, fast_sets
from .conftest import STEPS


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a host without CUDA")
@pytest.mark.parametrize("extra", [("--gpus", "4"), ("--gpus", "4", "--plan")], ids=["run", "plan"])
def test_a_cuda_job_on_a_host_without_cuda_fails_first(tmp_path, capsys, extra):
    """The README's headline command on a CPU host: one clear line, before any store, daemon or plan."""
    store = unique_store("first")
    run_dir = tmp_path / "run"
    rc = cli.main([str(TINY), *extra, "--set", f'store.name="{store}"', "--set", f'run.dir="{run_dir}"'])
    err = capsys.readouterr().err
    assert rc == 1
    assert err == (f"slidedp-launch: error: --gpus 4 asks for 4 CUDA rank(s) but no CUDA device is visible to this "
                   f"process (torch {torch.__version__} is a build without CUDA); nothing was started or created. Run "
                   f"on the CPU with --device cpu (runtime.device = \"cpu\"), or check the GPUs (`nvidia-smi`, "
                   f"CUDA_VISIBLE_DEVICES)\n") or torch.version.cuda is not None, err
    assert "no CUDA device is visible" in err and "Traceback" not in err
    assert store not in list_store_segments()
    assert not run_dir.exists() and not resolve_run_dir(store).path.exists()


def test_a_run_ends_with_a_summary_and_leaves_no_run_dir(tiny_run):
    """examples/tiny.toml (store.persist = false): the summary is the last thing printed, and the store's
    run directory under the socket root is gone with the store."""
    assert not resolve_run_dir(tiny_run.store).path.exists(), "the store's run directory was left behind"
    out = tiny_run.stdout
    tail = out[out.index("summary    "):].splitlines()
    assert re.fullmatch(rf"summary    steps 0\.\.{STEPS - 1} \({STEPS} committed\) in \d+\.\d s", tail[0]), tail
    assert re.fullmatch(r"           \S+ tokens/s median, \d+\.\d{3} s/step \(the first step, with the start-up, left "
                        r"out\)", tail[1]), tail
    assert re.fullmatch(r"loss       \d+\.\d{4} first, \d+\.\d{4} last", tail[2]), tail
    assert tail[3].startswith("time       per step (median, slowest rank): forward ") and "backward " in tail[3]
    assert tail[-1] == f"checkpoint {tiny_run.run_dir / 'checkpoints' / f'step-{STEPS:08d}'}"


def test_ctrl_c_stops_cleanly_with_exit_130_and_the_schedule_is_explained(tmp_path):
    """A store trained 2 steps by a job of train.steps = 2, trained further to 40: the start-up says what the
    learning rate does and how to choose otherwise; Ctrl-C then finishes the step, checkpoints, prints the
    summary and exits 130, so a script sees the job did not finish."""
    store = unique_store("first")
    run_dir = tmp_path / "run"
    try:
        call(store, "create", source="random", shape="tiny", vocab_size=512, init_seed=0)
        st = HostStore.attach(store)
        try:  # as a finished job of train.steps = 2 leaves it
            st.manifest.versions[:] = 2
            st.manifest.adam_steps[:] = 2
            st.manifest.set_committed_step(2)
            st.manifest.set_job({"job": "before", "hyper": job_to_dict(load_job(TINY, ["train.steps=2"]))["train"]})
        finally:
            st.close()
        run = RunningJob.start(TINY, fast_sets(store, run_dir, "train.steps=40"), tmp_path, store)
        try:
            run.wait_step(2, run_dir, timeout=240)
            run.proc.send_signal(signal.SIGINT)
            rc = run.wait_exit(240)
        finally:
            run.cleanup()
        out = run.output
        assert rc == 130, out[-4000:]
        assert re.search(r"learning rate: step 2 trains at \d\.\d{3}e-\d\d on a cosine schedule over steps 0\.\.39; the "
                         r"store's last job trained step 1 at \d\.\d{3}e-\d\d \(train\.steps 2 -> 40 stretches the "
                         r"schedule\)\. To continue the old schedule instead \(steps 2\.\.39 at \d\.\d{3}e-\d\d\), set "
                         r"train\.schedule_steps = 2; to start a new one over steps 2\.\.39 \(warmup 5, then cosine\), "
                         r"set train\.schedule_start = 2", out), out[-4000:]
        m = re.search(rf"stopped by SIGINT before train.steps = 40 \(checkpoint ({re.escape(str(run_dir))}/checkpoints/"
                      rf"step-\d{{8}})\); exit status 130", out)
        assert m and Path(m.group(1)).is_dir(), out[-4000:]
        assert re.search(r"summary    steps 2\.\.\d+ \(\d+ committed\) in \d+\.\d s; stopped early", out), out[-4000:]
        assert out.splitlines()[-1] == f"checkpoint {m.group(1)}", out[-2000:]
    finally:
        drop_store(store)


def test_schedule_keys_continue_or_restart_the_schedule():
    from slidedp.schedule import lr_at

    old = load_job(TINY).train  # 60 steps, warmup 5, cosine down to 3e-4
    stretched = load_job(TINY, ["train.steps=120"]).train
    kept = load_job(TINY, ["train.steps=120", "train.schedule_steps=60"]).train
    fresh = load_job(TINY, ["train.steps=120", "train.schedule_start=60"]).train
    assert all(lr_at(kept, s) == lr_at(old, s) for s in range(60))  # the old schedule, to the bit
    assert lr_at(kept, 60) == lr_at(kept, 119) == lr_at(old, 59) == pytest.approx(3e-4)
    assert lr_at(stretched, 60) > 5 * lr_at(old, 59)  # the jump the start-up line warns about
    assert [lr_at(fresh, 60 + s) for s in range(60)] == [lr_at(old, s) for s in range(60)]  # the same curve, shifted
