"""The launcher's side of planning: what it knows of the host and the data, handed to the planner.

The planner's one entry is `slidedp.planner.job.plan_for` (deliveries, routes, the job file's [plan]
values, the CPU plan; its measurements in a process of its own, so the launcher never holds a CUDA
context on the workers' GPU); what a run teaches it is `slidedp.planner.learn.record_training` (and, on
several hosts, `record_network`). Here
is what only the launcher can see: what the job's rows of documents cost attention (`document_load`),
and `plan_job`, the call the launcher and the dry run make. Whether the host holds the bf16 shadow of a
store the job creates is the admission's question (`host_room.shadow_fits`).
"""

from __future__ import annotations

from slidedp.config import JobConfig
from slidedp.section import ConfigError
from slidedp.planner.calibration import Calibration
from slidedp.planner.job import DeliveryError, JobPlan, StoreFacts, plan_for
from slidedp.planner.learn import record_network, record_training
from slidedp.planner.workload import DocumentLoad, HostRoom

__all__ = ["DeliveryError", "JobPlan", "check_layers", "document_load", "plan_job", "record_network", "record_training"]


def check_layers(job: JobConfig, cfg) -> str:
    """Whose layers run the job's model (plan.layers resolved), checked before any store is made: for
    transformers' layers, the worker's own set-up on the CPU (transformers builds this family from its
    config.json with the folder's very tensors, and the forward passes the probes of streaming; a model it
    cannot stream, or another model's tensors, is refused naming why; so is train.router_aux_loss = "on" for a
    model whose transformers class adds no auxiliary loss)."""
    from slidedp.planner.job import resolve_layers

    layers = resolve_layers(job, cfg)
    aux = job.train.adds_router_aux(cfg.source())
    if layers == "transformers":
        import torch

        from slidedp.model.generic import TransformersMath

        TransformersMath(cfg, torch.device("cpu"), torch.float32, router_aux=aux)
    elif aux:
        raise ConfigError(f"train.router_aux_loss = \"on\": this {cfg.family} model has no routers (SlideDP's own "
                          "layers run it); set it to \"auto\" or \"off\"")
    return layers


def document_load(batches) -> DocumentLoad | None:
    """What the job's rows of documents cost attention (None: token windows, each row one sequence, or rows
    of one document each, which attend as plain causal rows)."""
    from slidedp.data.packing import DocBatches

    if not isinstance(batches, DocBatches):
        return None
    lengths, row_offsets = batches.stream.document_lengths()
    if len(lengths) == len(row_offsets) - 1:  # one document per row: plain causal attention
        return None
    return DocumentLoad.of(lengths.tolist(), row_offsets.tolist())


def plan_job(job: JobConfig, calib: Calibration | None = None, store_shadow: bool | None = None,
             shadow_fits: bool = True, host_room: HostRoom | None = None,
             documents: DocumentLoad | None = None) -> JobPlan:
    """The job's step plan and its report (planner.job.plan_for). store_shadow, shadow_fits: what the
    launcher knows of the store (StoreFacts: None, the job creates it); host_room: what the host's memory
    leaves for offloaded layers and the shadow (host_room.room_for_plan; None: no limit); documents: what
    the job's rows of packed documents cost attention (document_load; None: plain rows); calib: this
    host's calibration (None: the planner reads or measures it)."""
    return plan_for(job, StoreFacts(store_shadow, shadow_fits), host_room, documents, calibration=calib)
