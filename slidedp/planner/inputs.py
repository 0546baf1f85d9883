"""What a CUDA plan needs of this host, measured in a process of its own: the launcher holds no CUDA
context on the workers' GPU. `measured_calibration` runs `python -m slidedp.planner.inputs`, which reads
the job's spec as JSON on stdin and prints one JSON line: {"calibration": ..., "blocks": ...}.

spec: {"gpus", "model_params", and, for the GPU blocks, "model" (ModelConfig.to_dict()), "seq_len",
"compute_dtype", "compiled", "compile_fallback", "local_batch", "sizes" ([micro_batch, seq_tile_tokens,
loss_chunk_tokens], ...), "layers" (whose layers run: "native" | "transformers"), and for rows of packed
documents "documents" (DocumentLoad.to_dict())}.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Mapping

from slidedp import log
from slidedp.model.config import ModelConfig
from slidedp.planner.cache import load_or_calibrate, measured_blocks, remeasure_host
from slidedp.planner.calibration import Calibration
from slidedp.planner.measure import MeasuredBlocks
from slidedp.planner.workload import DocumentLoad

_log = log.get("planner")


def plan_inputs(spec: Mapping[str, Any], device: str = "cuda") -> dict[str, Any]:
    """The calibration (with what runs of the model of spec["model_params"] measured, and the links
    among spec["gpus"] GPUs) and, where spec names the job's shape and sizes, the GPU blocks at them
    (from the host's cache, or measured now: then the host's rates are measured again, and each
    keeps the better of its two figures, cache.remeasure_host)."""
    calib = load_or_calibrate(device, gpus=int(spec.get("gpus", 1)), model_params=spec.get("model_params"))
    blocks = None
    if spec.get("sizes"):
        blocks = measured_blocks(
            ModelConfig.from_dict(spec["model"]), int(spec["seq_len"]), str(spec["compute_dtype"]),
            bool(spec["compiled"]), [tuple(s) for s in spec["sizes"]], int(spec["local_batch"]), calib.host,
            calib.device_name, device=device, compile_fallback=bool(spec.get("compile_fallback", True)),
            documents=DocumentLoad.from_dict(spec["documents"]) if spec.get("documents") else None,
            layers=str(spec.get("layers", "native")))
        if blocks.measured_s:  # a first plan of this shape: its blocks took tens of seconds since the calibration
            calib = remeasure_host(device, gpus=int(spec.get("gpus", 1)), model_params=spec.get("model_params"))
    return {"calibration": calib.to_dict(), "blocks": blocks.to_dict() if blocks else None}


def measured_calibration(gpus: int = 1, model_params: int | None = None, measure: dict | None = None,
                         timeout_s: float = 1800.0) -> Calibration:
    """This host's calibration, with what training runs of the model of `model_params` parameters
    measured on it (None: nothing learned); with gpus > 1 it includes the NCCL bus bandwidth among
    that many GPUs. measure: the job's shape and sizes (the spec above), whose GPU blocks come with it
    (read from the host's cache, or measured now: the first plan of a shape). Run in a subprocess."""
    spec = {"gpus": gpus, "model_params": model_params, **(measure or {})}
    if measure:
        _log.info("calibration and GPU blocks at this shape (%d size(s)): read from this host's cache, or measured "
                  "on the GPU now where this is the first plan of the shape here", len(measure.get("sizes", ())))
    out = subprocess.run([sys.executable, "-m", "slidedp.planner.inputs"], input=json.dumps(spec),
                         capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"calibrating this host's GPU failed: {out.stderr.strip()[-2000:]}")
    sys.stderr.write(out.stderr)  # its log lines (what it measured) belong in the job's log
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    blocks = MeasuredBlocks.from_dict(doc["blocks"]) if doc.get("blocks") else None
    if blocks is not None and blocks.measured_s:
        _log.info("measuring one decoder layer and the loss on the %s for this shape (first plan of it on this "
                  "host): %.1f s", blocks.device_name, blocks.measured_s)
    return Calibration.from_dict(doc["calibration"], blocks=blocks)


def main() -> int:
    log.setup("planner")  # what it measures goes to stderr, which the launcher writes into the job's log
    print(json.dumps(plan_inputs(json.loads(sys.stdin.read() or "{}"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
