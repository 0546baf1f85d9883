"""The store's service: the requests that create, attach, checkpoint, restore and destroy a store.

`HostStateCore` is the host-state daemon's logic (daemons/hoststate/shell.py serves it on the
store's control socket); slidedp-store serves it in-process when no daemon runs
(store/client.py). It creates a store (from a Hugging Face folder or the `random` source),
re-attaches to the segments after a restart, attaches and detaches jobs (creating their
gradient rings), and writes and restores checkpoints. It never unlinks a store unless told
to destroy it.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any

import psutil

from slidedp import log as slog
from slidedp.model.config import ModelConfig, named_shape
from slidedp.model.dtypes import torch_dtype
from slidedp.protocol import (KIND_OF, Attach, Checkpoint, CheckpointWait, ControlRequest, Create, Destroy, Detach,
                              Ping, Restore, Status)
from slidedp.store import checkpoint as ckpt
from slidedp.store.layout import make_layout
from slidedp.store.resume import restore_unless_held
from slidedp.store.rings import GradRings
from slidedp.store.shm import list_store_segments
from slidedp.store.part import StorePart
from slidedp.store.store import HostStore, fill_from_hf, fill_random

log = slog.get("hoststate")


class RequestError(RuntimeError):
    """A request that cannot be served; the text goes back to the client, the daemon carries on."""


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def model_from_source(req: Create) -> tuple[ModelConfig, dict[str, Any]]:
    """(model config, manifest meta) for a create request's source description."""
    if req.source == "random":
        cfg = named_shape(req.shape, int(req.vocab_size or 0) or None)
        return cfg, {"source": f"random:{req.shape}", "init_seed": int(req.init_seed)}
    if req.source == "hf":
        from slidedp.model import hf

        path = str(req.path)
        return hf.read_config(path), {"source": f"hf:{os.path.abspath(path)}"}
    raise RequestError(f"create: model source must be 'random' or 'hf', got {req.source!r}")


class HostStateCore:
    def __init__(self, store_name: str) -> None:
        self.name = store_name
        self.store: HostStore | None = None
        self.rings: GradRings | None = None
        self.writer: threading.Thread | None = None  # a checkpoint written while training goes on
        self.writer_result: dict[str, Any] | None = None
        if list_store_segments().get(store_name):
            self.store = HostStore.attach(store_name)
            log.info("re-attached to store %s: committed step %d, %s", store_name, self.store.manifest.committed_step,
                     self.store.manifest.torn_reason() or "clean")
            self.store.manifest.snapshot[:] = 0  # no checkpoint writer survives its daemon
            self._clear_stale_job()

    # ---- requests -------------------------------------------------------------------------
    def handle(self, req: ControlRequest) -> dict[str, Any]:
        """Serve one typed request; its result, or an error that refuses it (REFUSALS)."""
        handler = getattr(self, f"do_{KIND_OF.get(type(req))}", None)
        if handler is None:
            raise RequestError(f"unknown request {type(req).__name__}")
        return handler(req)

    def do_ping(self, req: Ping) -> dict[str, Any]:
        return {"pid": os.getpid(), "store": self.name, "exists": self.store is not None}

    def do_create(self, req: Create) -> dict[str, Any]:
        if self.store is not None:
            raise RequestError(f"store {self.name!r} already exists; destroy it first or attach to it")
        cfg, meta = model_from_source(req)
        if not req.persist:  # made by a job for itself: whoever finds it left behind must know
            meta.update(persist=False, creator=dict(req.creator or {}))
        limit = req.layer_chunk_numel
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise RequestError(f"create: layer_chunk_numel must be an integer >= 0 (0: whole layers), got {limit!r}")
        layout = make_layout(cfg, int(req.chunk_rows or 0) or None, limit)
        fill = fill_random(meta["init_seed"]) if req.source == "random" else fill_from_hf(req.path)
        t0 = time.perf_counter()
        log.info("creating store %s: %s, %s parameters, %d chunks", self.name, meta["source"],
                 f"{layout.num_parameters:,}", len(layout.chunks))
        try:
            part = StorePart(**req.part) if req.part else None
        except (TypeError, ValueError) as e:
            raise RequestError(f"create: part {req.part!r} is not a host's part of the state: {e}") from None
        self.store = HostStore.create(self.name, layout, meta, shadow=bool(req.shadow_bf16), fill=fill, part=part)
        seconds = time.perf_counter() - t0
        st = self.store.status()
        log.info("store %s created in %.2f s (%.2f GB/s page touch, %.3f bytes/parameter)", self.name, seconds,
                 self.store.creation_gbps, st["bytes_per_parameter"])
        return dict(st, create_s=seconds, touch_gbps=self.store.creation_gbps)

    def _need_store(self) -> HostStore:
        if self.store is None:
            raise RequestError(f"store {self.name!r} does not exist; create it first (`slidedp-store create {self.name} ...`)")
        return self.store

    def _clear_stale_job(self) -> None:
        store = self._need_store()
        pid = store.manifest.attached_pid
        if pid and not _alive(pid):
            log.warning("job of pid %d is gone without detaching; releasing it", pid)
            self._release_job()

    def _release_job(self) -> None:
        store = self._need_store()
        if self.rings is None:
            try:
                self.rings = GradRings.open(self.name)
            except FileNotFoundError:
                self.rings = None
        if self.rings is not None:
            self.rings.close()
            self.rings.unlink()
            self.rings = None
        store.manifest.set_attached(0, 0)

    def do_attach(self, req: Attach) -> dict[str, Any]:
        store = self._need_store()
        self._clear_stale_job()
        m = store.manifest
        if m.attached_pid:
            job = m.job()
            raise RequestError(
                f"store {self.name!r} already has a job attached: {job.get('job', '?')!r} (launcher pid {m.attached_pid}); "
                f"wait for it to finish or stop it"
            )
        want = req.layout_hash
        if want and want != store.layout.hash():
            raise RequestError(
                f"the job's model does not match store {self.name!r}: the store holds {m.meta.get('source')} "
                f"({store.layout.model.family}, {store.layout.num_parameters:,} parameters, layout {store.layout.hash()[:12]}), "
                f"the job asks for layout {str(want)[:12]} ({req.model_desc}); use another store name or destroy this one"
            )
        torn = m.torn_reason()
        if torn:
            raise RequestError(
                f"store {self.name!r} is torn ({torn}); restore a checkpoint first "
                f"(`slidedp-store restore {self.name} CHECKPOINT`, or run the job with checkpoint.resume = \"latest\")"
            )
        world, slots = int(req.world), int(req.grad_slots)
        if world < 1 or slots < 2:
            raise RequestError(f"attach: world must be >= 1 and grad_slots >= 2 (got {world}, {slots})")
        full = bool(req.full_reduce)
        self.rings = GradRings.create(self.name, store.layout, world, slots, int(req.reduce_slots), full,
                                      shard_slots=bool(req.shard_slots), shard_ranks=int(req.shard_ranks or 0))
        token = int.from_bytes(os.urandom(6), "little")
        record = {k: getattr(req, k) for k in ("job", "world", "grad_slots", "full_reduce", "hyper")}
        m.set_job(dict(record, attached=time.time(), token=token))
        m.set_attached(int(req.pid), token)
        log.info("job %r attached (pid %s, %d rank(s)) at committed step %d", req.job, req.pid, world,
                 m.committed_step)
        return {"committed_step": m.committed_step, "generation": m.generation, "token": token,
                "layout_hash": store.layout.hash()}

    def do_detach(self, req: Detach) -> dict[str, Any]:
        store = self._need_store()
        m = store.manifest
        if m.attached_pid and int(req.token) != m.attach_token:
            raise RequestError("detach: this job is not the one attached to the store")
        self._release_job()
        log.info("job detached at committed step %d (%s)", m.committed_step, m.torn_reason() or "clean")
        return {"committed_step": m.committed_step, "torn": m.torn_reason()}

    def do_status(self, req: Status) -> dict[str, Any]:
        if self.store is None:
            return {"store": self.name, "exists": False, "daemon_pid": os.getpid()}
        self._clear_stale_job()
        return dict(self.store.status(), exists=True, daemon_pid=os.getpid())

    def do_checkpoint(self, req: Checkpoint) -> dict[str, Any]:
        store = self._need_store()
        torn = store.manifest.torn_reason(allow_leased=True)
        if torn:
            raise RequestError(f"checkpoint refused: store {self.name!r} is torn ({torn})")
        dtype = torch_dtype(req.dtype)
        extra_files = [str(f) for f in req.extra_files or []]
        for f in extra_files:
            if not os.path.isfile(f):
                raise RequestError(f"checkpoint: extra file {f} does not exist")
        self._wait_writer()  # one checkpoint at a time
        step = store.manifest.committed_step
        # which store (and which creation of it) the state is of: a run directory's checkpoints say whose they are
        extra = dict(req.extra or {}, store=self.name, store_generation=store.manifest.generation)
        write = functools.partial(ckpt.write_checkpoint, store, req.dir, step, extra, dtype,
                                  int(req.keep), extra_files=extra_files)
        if not req.background:
            t0 = time.perf_counter()
            path = write()
            log.info("checkpoint of step %d written to %s in %.2f s", step, path, time.perf_counter() - t0)
            return {"path": str(path), "step": step}
        # Training goes on: every chunk is marked, the writer copies them in store order and releases
        # each as it goes; an updater about to overwrite a chunk not yet copied waits for it.
        m = store.manifest
        m.snapshot[:] = 1
        self.writer_result = None

        def release(chunk_id: int) -> None:
            m.snapshot[chunk_id] = 0

        def run() -> None:
            t0 = time.perf_counter()
            try:
                path = write(release=release)
                self.writer_result = {"path": str(path), "step": step}
                log.info("checkpoint of step %d written to %s in %.2f s while training went on", step, path,
                         time.perf_counter() - t0)
            except Exception as e:  # reported to whoever waits for it
                log.error("checkpoint of step %d failed: %s", step, e)
                self.writer_result = {"error": f"checkpoint of step {step} failed: {e}"}
            finally:
                m.snapshot[:] = 0

        self.writer = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self.writer.start()
        return {"step": step, "background": True}

    def _wait_writer(self) -> dict[str, Any] | None:
        if self.writer is not None:
            self.writer.join()
            self.writer = None
            return self.writer_result
        return None

    def do_checkpoint_wait(self, req: CheckpointWait) -> dict[str, Any]:
        """Block until the checkpoint being written in the background is complete; its path, or its error."""
        result = self._wait_writer()
        if result is None:
            return {"idle": True}
        if "error" in result:
            raise RequestError(result["error"])
        return result

    def do_restore(self, req: Restore) -> dict[str, Any]:
        store = self._need_store()
        self._wait_writer()
        pid = store.manifest.attached_pid
        if pid and _alive(pid) and int(req.token) != store.manifest.attach_token:
            raise RequestError(f"restore refused: a job (pid {pid}) is attached to store {self.name!r}")
        if req.unless_held:  # a job's resume: verified always, restored unless the store holds it already
            record, restored = restore_unless_held(store, req.path)
        else:
            record, restored = ckpt.restore_checkpoint(store, req.path), True
        if restored:
            log.info("restored %s: store %s now at step %d", req.path, self.name, record["step"])
        else:
            log.info("store %s already holds %s byte for byte (step %d)", self.name, req.path, record["step"])
        out = {"step": record["step"], "extra": record.get("extra", {})}
        return dict(out, restored=restored) if req.unless_held else out

    def do_destroy(self, req: Destroy) -> dict[str, Any]:
        store = self._need_store()
        self._wait_writer()
        pid = store.manifest.attached_pid
        if pid and _alive(pid) and not req.force:
            raise RequestError(f"destroy refused: a job (pid {pid}) is attached to store {self.name!r}")
        if self.rings is not None:
            self.rings.close()
            self.rings = None
        removed = store.destroy()
        self.store = None
        log.info("store %s destroyed (%d segments removed)", self.name, len(removed))
        return {"removed": removed}

    def close(self) -> None:
        self._wait_writer()
        if self.rings is not None:
            self.rings.close()
        if self.store is not None:
            self.store.close()


# What serving a request can raise that is answered as a refusal (the text goes back, the
# daemon serves on): the daemon and an in-process call (store/client.py) refuse alike.
REFUSALS = (RuntimeError, ValueError, TypeError, KeyError, OSError)


def refusal_text(e: BaseException) -> str:
    return str(e) if not isinstance(e, KeyError) else f"missing argument {e.args[0]!r}"
