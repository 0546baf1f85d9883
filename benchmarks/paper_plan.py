"""Plan a job for a host you do not have: what the launcher plans for a model's config.json on N GPUs with
G GiB of host memory, made here, off the GPU machine, from a calibration a device call brought back.

    python -m benchmarks.paper_plan CONFIG.json CAL.json --gpus 4 --host-gib 512 --batch 32 --seq 4096 \
        [--blocks BLOCKS.json] [--learned] [--budget-gib 24] [--clip 1.0] [--bus-gbps 240] \
        [--h2d-total-gbps 220] [--updaters 1] [--nnodes H] [--network-gbps 100] [--network-latency-us 20]
        [--set SECTION.KEY=VALUE ...]

CONFIG.json is a Hugging Face config.json (a dict: a published model's own). The model is built by
transformers on the meta device (no weights, no memory) and written as a folder of that config.json and a
safetensors file that holds the tensors' header and nothing else (a sparse file: its length is the
weights', its blocks are never written), so the launcher's own code reads it as it reads a real folder
(slidedp/model/hf_folder.py: the transformers path, the layer tables, fused experts). A quantized config
(`quantization_config`, as gpt-oss's MXFP4) is planned as its bf16 weights, which is what SlideDP trains.

CAL.json is a launcher cache's calibration file (`calibration-HOST-GPU.json`; the sessions return them as
`cache-*.json`): the GPU's copies and the host's rates as that host measured them. --blocks is its
`measured-HOST-GPU.json`: where it holds this model's shape at this sequence length, the GPU time is the
measured blocks' (a transformers shape whose key differs from this folder's only in the config's hash is
taken too, with a note); else the matmul FLOPs at the calibration's rate (the plan's note says which).
--learned charges the updaters' AdamW rate the file learned from runs of this model.

A host of several GPUs: the calibration of a one-GPU host measured no links among GPUs, so --bus-gbps
(the NCCL all-gather bus bandwidth among the N GPUs) and --h2d-total-gbps (all of them copying from host
memory at once) stand for what a calibration of that host would measure; without them the plan offers no
sharded route and each rank copies at the one GPU's rate.

Several hosts (--nnodes H, docs/multi-host.md): the plan of host 0 of H, each of N GPUs and --host-gib of host
memory, its share of the --batch sequences, with the step on H hosts: the network between them at
--network-gbps (Gb/s each way per host) and --network-latency-us (runtime.network_gbps, network_latency_us; 0:
the planner's assumption, 100 Gb/s and 20 us), the store's part (1/H of the state) against its memory.

Another GPU than the calibration's (--device-name): its matmul rate and PCIe rates are the calibrated GPU's
scaled by --tflops-scale and --pcie-scale (from public specs; the caller says which), its memory --gpu-mem-gib;
the host's rates (memory, AdamW, the sum) stay the calibrated host's.

It runs the launcher's admission (launch/admission.py:admit) on these facts: a store the job creates,
--host-gib of host memory available and as much in /dev/shm (--shm-gib), N GPUs. It prints the plan as
the launcher logs it before a run (`slidedp-launch --plan` prints the same table, planned without the
host's room) and the host memory the planned job takes, or why the host refuses it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from slidedp.config import job_from_dict, model_config
from slidedp.launch.admission import AdmissionFacts, HostFacts, StoreFacts, admit
from slidedp.launch.host_room import host_need, size
from slidedp.planner import cache, measure
from slidedp.planner.calibration import Calibration
from slidedp.planner.job import resolve_layers
from slidedp.planner.measure import MeasuredBlocks

GiB = 1 << 30
DTYPE_TAGS = {"torch.bfloat16": ("BF16", 2), "torch.float16": ("F16", 2), "torch.float32": ("F32", 4)}


def meta_shapes(hf: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, torch dtype) of every parameter transformers makes for this config, on the meta device
    (the weights in bf16; a quantization_config is left out: the bf16 model is what trains)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {k: v for k, v in hf.items() if k not in ("model_type", "quantization_config")}
    config = AutoConfig.for_model(hf["model_type"], **kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return {name: (tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()}


def write_folder(hf: dict[str, Any], out: Path) -> int:
    """A model folder without weights: config.json and model.safetensors holding the header of every tensor
    transformers makes for the config, its data a hole (a sparse file). Returns the parameter count."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if k != "quantization_config"}, indent=1))
    header, offset, count = {}, 0, 0
    for name, (shape, dtype) in meta_shapes(hf).items():
        tag, nbytes = DTYPE_TAGS[dtype]
        numel = 1
        for s in shape:
            numel *= s
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + numel * nbytes]}
        offset += numel * nbytes
        count += numel
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset)  # the weights' length, never written
    return count


def blocks_for(shapes: dict[str, MeasuredBlocks], key: str) -> tuple[MeasuredBlocks | None, str]:
    """The blocks of this shape key, or of the one transformers shape that differs from it only in the
    config's hash (the same layers written by another transformers version); with a note saying which."""
    if key in shapes:
        return shapes[key], f"GPU blocks of this shape from the blocks file ({key!r})"
    strip = lambda k: re.sub(r"transformers layers [0-9a-f]{12} ", "transformers layers * ", k)  # noqa: E731
    same = [k for k in shapes if strip(k) == strip(key)]
    if len(same) == 1:
        return (dataclasses.replace(shapes[same[0]], shape=key),
                f"GPU blocks of the shape {same[0]!r}: the same layers, its config.json written otherwise")
    return None, "no GPU blocks of this shape in the blocks file: the GPU time is the FLOPs'"


def job_dict(folder: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    d: dict[str, dict[str, Any]] = {
        "model": {"source": "hf", "path": str(folder)},
        "data": {"format": "npy", "path": str(folder / "tokens.npy")},
        "train": {"steps": 100, "global_batch": args.batch, "seq_len": args.seq, "lr": 1e-5,
                  "max_grad_norm": args.clip},
        "memory": {"device_budget_gib": args.budget_gib},
        "runtime": {"device": "cuda", "workers": args.gpus, "updaters": args.updaters},
    }
    if args.nnodes > 1:  # host 0 of them: the others plan the same
        d["runtime"].update(nnodes=args.nnodes, node_rank=0, master_addr="host-0", network_gbps=args.network_gbps,
                            network_latency_us=args.network_latency_us)
    for s in args.set:
        key, _, value = s.partition("=")
        section, _, name = key.partition(".")
        try:
            import tomllib

            d.setdefault(section, {})[name] = tomllib.loads(f"v = {value}")["v"]
        except Exception:  # noqa: BLE001  a bare word: a string, as the launcher's --set reads it
            d.setdefault(section, {})[name] = value
    return d


def calibration(args: argparse.Namespace, params: int) -> Calibration:
    calib = cache.load(args.calibration, params if args.learned else None)
    if args.device_name:  # another GPU, from public specs: its matmul rate and PCIe against the measured one's
        pcie = args.pcie_scale
        calib = dataclasses.replace(
            calib, device_name=args.device_name, device_tflops=calib.device_tflops * args.tflops_scale,
            device_adamw_params_per_s=calib.device_adamw_params_per_s * args.tflops_scale,
            device_mem_bytes=int(args.gpu_mem_gib * GiB) if args.gpu_mem_gib else calib.device_mem_bytes,
            h2d_gbps=calib.h2d_gbps * pcie, d2h_gbps=calib.d2h_gbps * pcie, bidir_gbps=calib.bidir_gbps * pcie,
            embedding_rows_gbps=calib.embedding_rows_gbps * pcie)
    if args.gpus > 1 and args.bus_gbps:
        calib = dataclasses.replace(calib, bus_gpus=args.gpus, allreduce_gbps=args.bus_gbps,
                                    h2d_total_gbps=args.h2d_total_gbps or 0.0)
    return calib


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", type=Path, help="the model's config.json")
    p.add_argument("calibration", type=Path, help="a launcher cache's calibration-HOST-GPU.json")
    p.add_argument("--blocks", type=Path, help="its measured-HOST-GPU.json (GPU blocks by shape)")
    p.add_argument("--learned", action="store_true", help="charge the AdamW rate runs of this model measured")
    p.add_argument("--gpus", type=int, default=1, help="GPUs, one rank each")
    p.add_argument("--host-gib", type=float, required=True, help="host memory available to the job")
    p.add_argument("--shm-gib", type=float, default=0.0, help="free in /dev/shm (default: --host-gib)")
    p.add_argument("--batch", type=int, required=True, help="train.global_batch, sequences per step")
    p.add_argument("--seq", type=int, default=2048, help="train.seq_len")
    p.add_argument("--budget-gib", type=float, default=24.0, help="memory.device_budget_gib per GPU")
    p.add_argument("--clip", type=float, default=1.0, help="train.max_grad_norm; 0: no clipping")
    p.add_argument("--updaters", type=int, default=1, help="runtime.updaters")
    p.add_argument("--bus-gbps", type=float, default=0.0, help="NCCL all-gather bus bandwidth among the GPUs")
    p.add_argument("--h2d-total-gbps", type=float, default=0.0, help="all GPUs copying from host memory at once")
    p.add_argument("--device-name", help="plan for this GPU instead of the calibration's: its figures scaled "
                   "by --tflops-scale and --pcie-scale, its memory --gpu-mem-gib (the host's stay)")
    p.add_argument("--tflops-scale", type=float, default=1.0, help="its matmul rate over the calibrated GPU's")
    p.add_argument("--pcie-scale", type=float, default=1.0, help="its PCIe copy rates over the calibrated GPU's")
    p.add_argument("--gpu-mem-gib", type=float, default=0.0, help="its memory, GiB (0: the calibrated GPU's)")
    p.add_argument("--nnodes", type=int, default=1, help="hosts, each of --gpus GPUs and --host-gib (runtime.nnodes)")
    p.add_argument("--network-gbps", type=float, default=0.0,
                   help="Gb/s each way per host between the hosts (runtime.network_gbps; 0: the planner's 100)")
    p.add_argument("--network-latency-us", type=float, default=0.0,
                   help="latency of a ring step between the hosts (runtime.network_latency_us; 0: the planner's 20)")
    p.add_argument("--set", action="append", default=[], help="SECTION.KEY=VALUE of the job file (repeatable)")
    p.add_argument("--folder", type=Path, help="write the model folder here and keep it (default: a temporary one)")
    a = p.parse_args(argv)
    hf = json.loads(a.config.read_text())
    with tempfile.TemporaryDirectory(prefix="paper-plan-") as tmp:
        folder = a.folder or Path(tmp) / "model"
        write_folder(hf, folder)
        (folder / "tokens.npy").write_bytes(b"")  # the job file names its data; the plan reads none
        job = job_from_dict(job_dict(folder, a), folder, "paper")
        model = model_config(job)
        calib = calibration(a, model.num_parameters())
        notes = []
        if a.blocks:
            key = measure.shape_key(model, a.seq, job.plan.dtype, job.train.compile in ("auto", "on"), None,
                                    resolve_layers(job, model))
            blocks, note = blocks_for(cache.read_blocks(a.blocks, cache.READABLE_SCHEMAS), key)
            calib, notes = dataclasses.replace(calib, blocks=blocks), [note]
        host = HostFacts(int(a.host_gib * GiB), int((a.shm_gib or a.host_gib) * GiB))
        decision = admit(AdmissionFacts(job, model, StoreFacts(), host, gpus=a.gpus, calibration=calib))
        hosts = f"host 0 of {a.nnodes}, each " if a.nnodes > 1 else ""
        print(f"paper plan: {a.config.name} on {hosts}{a.gpus} x {calib.device_name} (calibration of {calib.host}, "
              f"{a.calibration.name}), {a.host_gib:g} GiB of host memory; {model.num_parameters() / 1e9:.2f} B "
              f"parameters")
        for n in notes:
            print(f"paper plan: {n}")
        if decision.plan is not None:
            print(decision.plan.describe())
            need = host_need(job, decision.layout, decision.plan.step, False, decision.plan.shadow,
                             decision.device_chunks)
            per = f" on each of the {a.nnodes} hosts (its part: 1/{a.nnodes} of the state)" if a.nnodes > 1 else ""
            print(f"\nhost memory of the planned job{per}: {size(need.total)} of {size(host.available)} "
                  f"({need.describe()})")
        for f in decision.problems:
            print(f"refused ({f.topic}): {f.text}")
        for f in decision.warnings:
            print(f"warning ({f.topic}): {f.text}")
    return 1 if decision.problems else 0


if __name__ == "__main__":
    sys.exit(main())
