"""Checks a run makes before it starts anything: a CUDA job on a host where no GPU is visible fails here,
with what to do, instead of after creating the store and starting the daemons."""

from __future__ import annotations

import os
import subprocess
import sys

from slidedp.config import JobConfig

_PROBE = "import torch; print(torch.cuda.device_count(), torch.__version__, torch.version.cuda or '-')"


def cuda_probe(timeout_s: float = 120.0) -> tuple[int, str]:
    """(GPUs visible to the workers, why none are when that is 0), asked of a subprocess so that the
    launcher itself never holds a CUDA context."""
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        return 0, f"importing torch failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}"
    count, version, cuda = out.stdout.split()[-3:]
    if int(count):
        return int(count), ""
    if cuda == "-":
        return 0, f"torch {version} is a build without CUDA"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return 0, (f"torch {version} (CUDA {cuda}) finds no GPU" +
               (f" with CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else " (is the driver loaded?)"))


def cuda_problem(job: JobConfig, asked_by: str) -> str | None:
    """Why a CUDA job cannot run on this host, naming what asked for CUDA (e.g. "--gpus 4"); None if it can."""
    if job.runtime.device != "cuda":
        return None
    count, why = cuda_probe()
    if count:
        return None
    return (f"{asked_by} asks for {job.runtime.workers} CUDA rank(s) but no CUDA device is visible to this process "
            f"({why}); nothing was started or created. Run on the CPU with --device cpu (runtime.device = \"cpu\"), "
            f"or check the GPUs (`nvidia-smi`, CUDA_VISIBLE_DEVICES)")
