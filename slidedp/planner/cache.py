"""The host's cache of what was measured on it: the calibration, the GPU blocks, and what runs learned.

JSON (never pickle), one file per host and device name, under cache_root() (~/.cache/slidedp):
`calibration-HOST-DEVICE.json`, the measured building blocks (calibrate.py) with what training runs
measured (`record_training`) kept per model, so that a host that trains several models keeps each
one's figures; `measured-HOST-DEVICE.json`, the GPU blocks of every shape planned on this host
(measure.py), so that a second plan of a shape reads them and a plan that weighs a size not measured
yet measures only that size. Every read-modify-write holds the file's lock: one job measures at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import re
import socket
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from slidedp import log
from slidedp.model.config import ModelConfig
from slidedp.planner.calibrate import (HOST_RATE_FIELDS, calibrate, device_label, embedding_rows_fields,
                                       host_memory_fields, host_rates)
from slidedp.planner.calibration import (LEARNED_FIELDS, LEARNED_GROUPS, MODEL_SHARES, NETWORK_FIELDS, NOTHING_LEARNED,
                                         RETIRED_FIELDS, Calibration, CalibrationError)
from slidedp.planner.measure import SCHEMA as BLOCKS_SCHEMA
from slidedp.planner.measure import MeasuredBlocks, MeasureError, Size, measure_blocks, normalized, shape_key
from slidedp.planner.workload import DocumentLoad

_log = log.get("planner")

SCHEMA = 1  # of a calibration file


# --------------------------------------------------------------------------------------
# the calibration

def slug(text: str) -> str:
    """A host or device name as a file name's part."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "unknown"


def cache_path(device: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """This host's calibration file for `device`."""
    return _cache_file(socket.gethostname(), device_label(device), cache_dir)


def cache_root(env: Mapping[str, str] | None = None) -> Path:
    """Where host calibrations are kept: $SLIDEDP_CACHE_DIR, else $XDG_CACHE_HOME/slidedp, else
    ~/.cache/slidedp. The test suite points SLIDEDP_CACHE_DIR elsewhere: a calibration measured
    while its tests load the host would be kept and charged to the user's next plans."""
    env = os.environ if env is None else env
    if env.get("SLIDEDP_CACHE_DIR"):
        return Path(env["SLIDEDP_CACHE_DIR"]).expanduser()
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]).expanduser() / "slidedp"
    return Path("~/.cache/slidedp").expanduser()


def _cache_file(host: str, device_name: str, cache_dir: str | os.PathLike | None) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir else cache_root()
    return root / f"calibration-{slug(host)}-{slug(device_name)}.json"


def _learned_model(fields: Mapping[str, Any]) -> int:
    """The parameter count of the model whose training measured `fields` (0: none)."""
    return next((int(fields[m]) for m in LEARNED_GROUPS if fields.get(m)), 0)


def _with_learned(calib: Calibration, fields: Mapping[str, Any]) -> Calibration:
    """calib carrying exactly `fields` of what training runs measured (nothing else learned; the runs
    each figure is the median of stay in the cache file)."""
    return dataclasses.replace(calib, **{**NOTHING_LEARNED, **{k: v for k, v in fields.items() if k != _RECENT}})


def _learned_of(calib: Calibration) -> dict[int, dict[str, Any]]:
    """A calibration's own learned fields, per model (a file from before the per-model figures held
    each group of them for the model that group names)."""
    out: dict[int, dict[str, Any]] = {}
    for model_key, values in LEARNED_GROUPS.items():
        if getattr(calib, model_key):
            out.setdefault(getattr(calib, model_key), {}).update(
                {model_key: getattr(calib, model_key), **{v: getattr(calib, v) for v in values}})
    return out


# A model's learned rate is the median of what its last RECENT_RUNS runs on this host measured: on one
# H200 the updaters' rate moved by up to 26% from one run of a plan to the next (2.45-3.16 G params/s in
# five runs of one model; docs/tuning.md, in git history), and a plan that charged the last run's figure alone was 18% off.
RECENT_RUNS = 5
_RECENT = "recent"  # a learned entry's key for those runs' figures, per field


def _merged(entry: Mapping[str, Any], measured: Mapping[str, Any]) -> dict[str, Any]:
    """A model's figures updated by a run's: each measured rate becomes the median of the model's last
    RECENT_RUNS runs that measured it (an entry from before the runs were kept counts as one run);
    fields the run did not measure are kept."""
    recent = {k: list(v) for k, v in entry.get(_RECENT, {}).items()}
    out = {**entry, **measured}
    for field, value in measured.items():
        if field in LEARNED_GROUPS:  # the model's parameter count, not a rate
            continue
        runs = recent.get(field) or ([entry[field]] if entry.get(field) else [])
        recent[field] = [*runs, value][-RECENT_RUNS:]
        out[field] = statistics.median(recent[field])
    out[_RECENT] = recent
    return out


def _checked_recent(recent: Any) -> dict[str, list[float]] | None:
    """A learned entry's recent runs, or None when they are not lists of up to RECENT_RUNS positive rates."""
    rates = set(LEARNED_FIELDS) - set(LEARNED_GROUPS)
    if not (isinstance(recent, dict) and set(recent) <= rates and all(
            isinstance(v, list) and 0 < len(v) <= RECENT_RUNS and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in v)
            for v in recent.values())):
        return None
    return {k: [float(x) for x in v] for k, v in recent.items()}


@contextlib.contextmanager
def locked(path: Path):
    """Serialize the read-modify-write of a cache file among the jobs of one host."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def record_training(calib: Calibration, cache_dir: str | os.PathLike | None = None, **measured: Any) -> Calibration:
    """Keep what a training run measured (the `*_train_*` fields of one model) with the host's
    calibration (the file `calib` came from; no CUDA needed to find it), for the next plan of that
    model: beside what runs of other models measured, and over what earlier runs of this model did
    (`_merged`). Returns the file's calibration with this model's figures. Raises OSError where the
    cache cannot be written."""
    unknown = sorted(k for k in measured if k not in LEARNED_FIELDS)
    if unknown:
        raise ValueError(f"record_training: {unknown} are not measured in training")
    model = _learned_model(measured)
    if not model:
        raise ValueError("record_training: the measured fields name no model (a *_model_params field)")
    path = _cache_file(calib.host, calib.device_name, cache_dir)
    with locked(path):
        try:
            current, learned = _read(path)
        except CalibrationError as e:  # unreadable: what this run measured starts a new file
            _log.warning("rewriting %s: %s", path, e)
            current, learned = _with_learned(calib, {}), {}
        learned[model] = _merged(learned.get(model, {}), measured)
        save(current, path, learned)
    return _with_learned(current, learned[model])


def save(calib: Calibration, path: str | os.PathLike, learned: Mapping[int, Mapping[str, Any]] | None = None) -> None:
    """Write a calibration's measured building blocks and, per model, what training runs measured
    (`learned`; a calibration's own learned fields are not kept)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    figures = {k: v for k, v in _with_learned(calib, {}).to_dict().items() if k not in MODEL_SHARES + NETWORK_FIELDS}
    doc: dict[str, Any] = {"schema": SCHEMA, "calibration": figures}
    if learned:
        doc["learned"] = {str(k): dict(v) for k, v in sorted(learned.items())}
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def _checked_entry(calib: Calibration, key: Any, fields: Any) -> dict[str, Any] | None:
    """A model's learned entry with its values converted, or None when it is not one: fields that are
    not measured in training, values of the wrong kind, a model named other than its key."""
    if not (isinstance(fields, dict) and str(key).isdigit() and set(fields) <= set(LEARNED_FIELDS)):
        return None
    try:
        full = Calibration.from_dict({**calib.to_dict(), **NOTHING_LEARNED, **fields})
    except (CalibrationError, TypeError, ValueError):
        return None
    entry = {k: getattr(full, k) for k in fields}
    if any(entry.get(m, int(key)) != int(key) for m in LEARNED_GROUPS):
        return None
    return entry


def _read(path: str | os.PathLike) -> tuple[Calibration, dict[int, dict[str, Any]]]:
    """A cache file's calibration (nothing learned in it) and what runs measured, per model. An
    entry that is not a model's measured fields is left out, with a warning naming it."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CalibrationError(f"cannot read calibration {path}: {e}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("calibration"), dict):
        raise CalibrationError(f"calibration {path} is not a schema-{SCHEMA} calibration file")
    retired = sorted(set(doc["calibration"]) & set(RETIRED_FIELDS))
    try:
        calib = Calibration.from_dict({k: v for k, v in doc["calibration"].items()
                                       if k not in RETIRED_FIELDS + MODEL_SHARES + NETWORK_FIELDS})
    except (TypeError, ValueError) as e:
        raise CalibrationError(f"calibration {path}: {e}") from None
    learned = _learned_of(calib)  # a file from before the per-model figures
    entries = doc.get("learned") or {}
    for key, fields in (entries.items() if isinstance(entries, dict) else ()):
        if isinstance(fields, dict) and set(fields) & set(RETIRED_FIELDS):
            retired = sorted(set(retired) | (set(fields) & set(RETIRED_FIELDS)))
            fields = {k: v for k, v in fields.items() if k not in RETIRED_FIELDS}
            if not fields:
                continue
        runs = fields.get(_RECENT) if isinstance(fields, dict) else None
        if runs is not None:
            fields = {k: v for k, v in fields.items() if k != _RECENT}
        entry = _checked_entry(calib, key, fields)
        if entry is None:
            _log.warning("%s: learned entry %r is not a model's measured fields; left out", path, key)
            continue
        if runs is not None:
            recent = _checked_recent(runs)
            if recent is None:  # the figures stay; the next run starts the list anew from them
                _log.warning("%s: learned entry %r: its recent runs are not lists of up to %d rates; left out",
                             path, key, RECENT_RUNS)
            else:
                entry[_RECENT] = {k: v for k, v in recent.items() if k in entry}
        learned[int(key)] = entry
    if retired:
        _log.info("%s: %s (GPU-time factors learned from runs) ignored: plans now measure the GPU work at "
                  "the job's shapes; the next write drops them", path, ", ".join(retired))
    return _with_learned(calib, {}), learned


def _for_model(calib: Calibration, learned: Mapping[int, Mapping[str, Any]], model_params: int | None) -> Calibration:
    return calib if model_params is None else _with_learned(calib, learned.get(int(model_params), {}))


def load(path: str | os.PathLike, model_params: int | None = None) -> Calibration:
    """The calibration of a cache file; with model_params, carrying what training runs of that model
    measured (none: nothing learned)."""
    return _for_model(*_read(path), model_params)


def load_or_calibrate(
    device: str = "cuda", cache_dir: str | os.PathLike | None = None, quick: bool = False, refresh: bool = False,
    gpus: int = 1, model_params: int | None = None,
) -> Calibration:
    """The cached calibration of this host and device, measured (and cached) if absent or unreadable.
    gpus > 1: also the GPU links among that many GPUs (measured once, kept in the same file).
    model_params: with what training runs of that model on this host measured (`load`).
    refresh: measure again and forget what training runs measured (after a hardware change)."""
    path = cache_path(device, cache_dir)
    with locked(path):  # one job measures at a time: two at once would measure each other
        calib, learned = None, {}
        if path.exists() and not refresh:
            try:
                calib, learned = _read(path)
            except CalibrationError as e:
                _log.warning("recalibrating: %s", e)
        changed = fresh = calib is None
        if calib is None:
            calib = calibrate(device, quick=quick)
            _log.info("calibrated %s", calib.summary())
        if gpus > 1:
            gpus = min(gpus, _visible_gpus(device))  # asked for more than are visible: the visible ones (CPU: 1)
        if gpus > 1 and calib.bus_gpus < gpus:
            from slidedp.planner.links import measure_links

            links = measure_links(gpus)
            calib = dataclasses.replace(calib, allreduce_gbps=links["bus_gbps"],
                                        h2d_total_gbps=links["h2d_total_gbps"], bus_gpus=gpus)
            _log.info("measured the links among %d GPUs: %.0f GB/s bus, %.0f GB/s of copy-in in all", gpus,
                      calib.allreduce_gbps, calib.h2d_total_gbps)
            changed = True
        if not fresh and not calib.host_copy_gbps:  # a cache file from before host memory was measured
            calib = dataclasses.replace(calib, **host_memory_fields(quick))
            _log.info("measured this host's memory: copy %.1f GB/s (read %.1f, write %.1f)", calib.host_copy_gbps,
                      calib.host_read_gbps, calib.host_write_gbps)
            changed = True
        if device.startswith("cuda") and not fresh and not calib.embedding_rows_gbps:  # a cache from before it
            calib = dataclasses.replace(calib, **embedding_rows_fields(device, quick))
            if calib.embedding_rows_gbps:
                _log.info("a host-held embedding's rows reach the GPU at %.1f GB/s (%s)", calib.embedding_rows_gbps,
                          calib.embedding_rows_how)
                changed = True
        if device.startswith("cuda") and calib.adamw_beside_copies_gpus < gpus:
            from slidedp.planner.measure import adamw_beside_copies

            rate = adamw_beside_copies(calib.adamw_threads, device, gpus)
            calib = dataclasses.replace(calib, adamw_beside_copies_params_per_s=rate, adamw_beside_copies_gpus=gpus)
            _log.info("the fused CPU AdamW ran at %.2f G params/s beside pinned copies on %d GPU(s) (bare: %.2f)",
                      rate / 1e9, gpus, calib.adamw_params_per_s / 1e9)
            changed = True
        if changed:
            save(calib, path, learned)
            _log.info("calibration cached in %s", path)
    return _for_model(calib, learned, model_params)


def remeasure_host(device: str = "cuda", cache_dir: str | os.PathLike | None = None, quick: bool = False,
                   gpus: int = 1, model_params: int | None = None,
                   measure: Callable[..., Mapping[str, Any]] | None = None) -> Calibration:
    """The cached calibration with HOST_RATE_FIELDS measured again (`measure`, default host_rates), each
    the better of the cached and the new figure (the cache keeps it). Needs a cached calibration
    (load_or_calibrate first)."""
    path = cache_path(device, cache_dir)
    with locked(path):
        calib, learned = _read(path)
        again = (measure or host_rates)(device, calib.adamw_threads, max(1, calib.adamw_beside_copies_gpus or gpus), quick)
        better = {f: float(again[f]) for f in HOST_RATE_FIELDS if again.get(f, 0) > getattr(calib, f)}
        if "host_copy_gbps" in better:  # the nodes' rates go with the copy rate they add up to
            better["host_node_copy_gbps"] = str(again.get("host_node_copy_gbps", ""))
        if "embedding_rows_gbps" in better:  # and the way the rows were gathered with their rate
            better["embedding_rows_gather"] = str(again.get("embedding_rows_gather", ""))
        changes = [f"{f} {getattr(calib, f):.4g} -> {again[f]:.4g}" for f in HOST_RATE_FIELDS if f in again]
        _log.info("measured the host again after the blocks (each keeps the better): %s", "; ".join(changes))
        if better:
            calib = dataclasses.replace(calib, **better)
            calib = dataclasses.replace(calib, bidir_gbps=max(calib.bidir_gbps, calib.h2d_gbps, calib.d2h_gbps))
            save(calib, path, learned)
    return _for_model(calib, learned, model_params)




def _visible_gpus(device: str) -> int:
    if not device.startswith("cuda"):
        return 1
    import torch

    return torch.cuda.device_count()


# --------------------------------------------------------------------------------------
# the GPU blocks

def blocks_file(host: str, device_name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The host's file of measured GPU blocks for one device name (every shape planned on it)."""
    root = Path(cache_dir).expanduser() if cache_dir else cache_root()
    return root / f"measured-{slug(host)}-{slug(device_name)}.json"


# schema 1 holds the same fields, timed by single runs: a plan measures them again, a replay reads them
READABLE_SCHEMAS = (1, BLOCKS_SCHEMA)


def read_blocks(path: str | os.PathLike, schemas: tuple[int, ...] = (BLOCKS_SCHEMA,)) -> dict[str, MeasuredBlocks]:
    """A cache file's blocks by shape; an unreadable file or entry, or a schema not in `schemas`, is left
    out with a warning (a plan passes the current schema only: older blocks are measured again)."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        _log.warning("%s is unreadable (%s): measuring again", path, e)
        return {}
    if not isinstance(doc, dict) or doc.get("schema") not in schemas or not isinstance(doc.get("shapes"), dict):
        _log.warning("%s is not a schema-%d file of measured blocks (an older one is measured again, once): "
                     "measuring again", path, BLOCKS_SCHEMA)
        return {}
    out = {}
    for shape, entry in doc["shapes"].items():
        try:
            out[shape] = MeasuredBlocks.from_dict(entry)
        except MeasureError as e:
            _log.warning("%s: the entry for %r is left out: %s", path, shape, e)
    return out


def _write_blocks(path: Path, shapes: Mapping[str, MeasuredBlocks]) -> None:
    doc = {"schema": BLOCKS_SCHEMA, "shapes": {k: replace(b, measured_s=0.0).to_dict() for k, b in sorted(shapes.items())}}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def measured_blocks(model: ModelConfig, seq_len: int, compute_dtype: str, compiled: bool, sizes: Iterable[Size],
                    local_batch: int, host: str, device_name: str, device: str = "cuda",
                    cache_dir: str | os.PathLike | None = None, measure: Callable[..., MeasuredBlocks] = measure_blocks,
                    compile_fallback: bool = True, documents: DocumentLoad | None = None,
                    layers: str = "native") -> MeasuredBlocks:
    """The blocks of this shape at `sizes` (run by `layers`: SlideDP's or transformers'): from the host's
    cache, measuring (and keeping) the sizes it lacks. `measured_s` says how long that took (0: nothing
    measured)."""
    key = shape_key(model, seq_len, compute_dtype, compiled, documents, layers)
    sizes = sorted({(m, normalized(m, seq_len, tile), chunk) for m, tile, chunk in sizes})
    path = blocks_file(host, device_name, cache_dir)
    with locked(path):  # one job measures at a time: two at once would measure each other
        shapes = read_blocks(path)
        have = shapes.get(key, MeasuredBlocks(key, device_name))
        missing = [s for s in sizes if not have.has(s)]
        if not missing:
            return have
        t0 = time.perf_counter()
        new = measure(model, seq_len, compute_dtype, compiled, missing, local_batch, device=device,
                      compile_fallback=compile_fallback, device_name=device_name,
                      **({"documents": documents} if documents is not None else {}),
                      **({"layers": layers} if layers != "native" else {}))
        if new.shape != key:
            raise MeasureError(f"measured blocks of {new.shape!r}, wanted {key!r}")
        shapes[key] = have.merged(new)
        _write_blocks(path, shapes)
    return replace(shapes[key], measured_s=time.perf_counter() - t0)

