"""Chunks held on the device for a whole job: the embedding (and an untied head), and the first decoder
layers, with their AdamW state.

The embedding's gradient is complete last in backward and the next forward needs it first,
so on the host its update is the exposed tail. Where the GPU budget allows, the planner
leases these chunks to the workers instead: every rank holds the fp32 master and both
moments on its device (replicated; gradients all-reduced among ranks), updates them with
the fused AdamW on the device, and rank 0 writes them back to the store at checkpoints and
at the end. While leased, the store marks the chunks (updating = LEASED): a job that dies
holding them leaves the store torn, never silently stale. The first decoder layers are the
same tail in the middle of the model: held, the next forward starts without waiting for the
host, and the updaters have that much less to do.
"""

from __future__ import annotations

import torch

from .collectives import Group
from ..config import TrainSection
from ..schedule import lr_at
from ..store.layout import Unit, unit_tensors
from ..store.manifest import LEASED
from ..store.store import HostStore


class DeviceHeld:
    def __init__(self, store: HostStore, unit: Unit, device: torch.device, dtype: torch.dtype, train: TrainSection,
                 rank: int, group: Group | None) -> None:
        self.store, self.unit, self.device, self.dtype, self.train = store, unit, device, dtype, train
        self.rank, self.group = rank, group
        rng = slice(unit.offset, unit.offset + unit.numel)
        self.state = {k: store.flat(k)[rng].to(device, copy=True) for k in ("master", "exp_avg", "exp_avg_sq")}
        ids = [c.id for c in unit.chunks]
        steps = {int(store.manifest.adam_steps[i]) for i in ids}
        if len(steps) != 1:
            raise RuntimeError(f"{unit.name} chunks have different AdamW step counts {sorted(steps)}; restore a checkpoint")
        self.adam_steps = steps.pop()
        self.weight = self.state["master"] if dtype == torch.float32 else self.state["master"].to(dtype)
        if rank == 0:
            for i in ids:
                store.manifest.updating[i] = LEASED

    def tensors(self, strip: str = "") -> dict[str, torch.Tensor]:
        """The unit's tensors in the compute dtype (views of the device copy), keyed by name minus `strip`."""
        return unit_tensors(self.weight, self.unit, strip)

    def reduce(self, grad: torch.Tensor) -> float:
        """All-reduce the ranks' gradients (sum); returns the squared norm of the summed gradient."""
        if self.group is not None:
            self.group.all_reduce(grad)
        return float(torch.dot(grad, grad))

    def update(self, grad: torch.Tensor, step: int, clip_coef: float | None) -> None:
        """Fused AdamW on the device: the same arithmetic the updater pool runs on the host."""
        t = self.train
        self.adam_steps += 1
        scale = None
        if clip_coef is not None and clip_coef < 1.0:
            scale = torch.tensor(1.0 / clip_coef, dtype=torch.float32, device=self.device)
        views = {k: unit_tensors(v, self.unit) for k, v in self.state.items()}
        gviews = unit_tensors(grad, self.unit)
        step_t = torch.tensor(float(self.adam_steps), device=self.device)
        for decay in (True, False):
            names = [n for n, v in views["master"].items() if (v.dim() >= 2) == decay]
            if not names:
                continue
            torch._fused_adamw_(
                [views["master"][n] for n in names], [gviews[n] for n in names],
                [views["exp_avg"][n] for n in names], [views["exp_avg_sq"][n] for n in names], [],
                [step_t] * len(names), lr=lr_at(t, step), beta1=t.beta1, beta2=t.beta2,
                weight_decay=t.weight_decay if decay else 0.0, eps=t.eps, amsgrad=False, maximize=False,
                grad_scale=scale, found_inf=None,
            )
        if self.weight is not self.state["master"]:
            self.weight.copy_(self.state["master"])

    def write_back(self, version: int, release: bool) -> None:
        """Rank 0: copy the state into the store as of `version`; release the lease at the job's end."""
        if self.rank != 0:
            return
        m = self.store.manifest
        for c in self.unit.chunks:  # a checkpoint still copying the previous state comes first
            m.wait_snapshot(c.id)
        rng = slice(self.unit.offset, self.unit.offset + self.unit.numel)
        for k, v in self.state.items():
            self.store.flat(k)[rng].copy_(v)
        for c in self.unit.chunks:
            self.store.refresh_shadow(c)
            m.adam_steps[c.id] = self.adam_steps
            m.versions[c.id] = version
            if release:
                m.updating[c.id] = 0
