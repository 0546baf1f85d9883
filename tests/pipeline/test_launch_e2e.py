"""slidedp-launch end to end on the README's demo job: 2 CPU workers, embedded daemons.

The loss falls, the final checkpoint is a Hugging Face folder that `transformers` loads with the
same weights the store held, and nothing is left behind: no process, no /dev/shm segment.
"""

from __future__ import annotations

import psutil
import torch

from .harness import TINY, checkpoint_weights, launch, metrics, store_segments, unique_store


def test_demo_job_trains_checkpoints_and_cleans_up(tmp_path):
    store = unique_store("demo")
    run_dir = tmp_path / "run"
    before = {p.pid for p in psutil.process_iter()}
    proc = launch(TINY, f'store.name="{store}"', f'run.dir="{run_dir}"', "train.steps=30", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    got = metrics(run_dir)
    assert [m["step"] for m in got] == list(range(30))
    first, last = got[0]["loss"], sum(m["loss"] for m in got[-5:]) / 5
    assert abs(first - torch.log(torch.tensor(512.0)).item()) < 0.1  # a fresh model guesses uniformly
    assert last < first - 1.0, (first, last)

    ckpt = run_dir / "checkpoints" / "step-00000030"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt / "model", dtype=torch.float32)
    ours = checkpoint_weights(ckpt)
    theirs = dict(model.named_parameters())
    for name, tensor in ours.items():
        assert torch.equal(theirs[name].detach(), tensor), name
    assert (ckpt / "model" / "tokenizer.json").is_file()

    assert store_segments(store) == []
    # every process of the job names its store on its command line (daemons and workers alike)
    leftover = [p for p in psutil.process_iter(["pid", "cmdline"])
                if p.pid not in before and store in " ".join(p.info["cmdline"] or [])]
    assert leftover == [], [p.info["cmdline"] for p in leftover]
