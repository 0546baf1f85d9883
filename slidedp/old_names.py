"""Names older SlideDP versions wrote, and what they are called now: the one place that knows them.

Data on disk outlives a rename: a host's calibration cache, a run's metrics.jsonl, a job file.
Readers of such data pass its keys through here (`current` for records, `train_record` for a
stored job record's [train]; `move_job_keys`, `override_key`, `job_key` and `job_setting` for
job-file keys, which may also have moved to another section); nothing else spells an old name.
"""

from __future__ import annotations

from typing import Any, Mapping

from slidedp import log

_log = log.get("config")

# record keys ("gpu" became "device" where it means the training device)
RENAMED: dict[str, str] = {
    # a host's calibration cache (planner/cache.py)
    "gpu_tflops": "device_tflops",
    "gpu_mem_bytes": "device_mem_bytes",
    "gpu_adamw_params_per_s": "device_adamw_params_per_s",
    # a run's metrics.jsonl (launch/progress.py)
    "gpu_peak_bytes": "device_peak_bytes",
    "gpu_reserved_peak_bytes": "device_reserved_peak_bytes",
    "planned_gpu_bytes": "planned_device_bytes",
}

# job-file keys, "section.key": still accepted, with a warning naming the new key
JOB_KEYS: dict[str, str] = {
    "memory.gpu_budget_gib": "memory.device_budget_gib",
    # the plan's choices, once in three sections, are the [plan] section's (slidedp/plan_section.py)
    "train.micro_batch": "plan.micro_batch",
    "train.compute_dtype": "plan.compute_dtype",
    "memory.embedding": "plan.embedding",
    "memory.resident_layers": "plan.resident_layers",
    "memory.seq_tile_tokens": "plan.seq_tile_tokens",
    "memory.offload_layers": "plan.offload_layers",
    "memory.device_layers": "plan.device_layers",
    "memory.prefetch_depth": "plan.prefetch_depth",
    "runtime.param_route": "plan.param_route",
    "runtime.grad_route": "plan.grad_route",
    "runtime.delivery": "plan.delivery",
}
# an old key's value that says "the plan decides", and what the new key calls it
JOB_SENTINELS: dict[str, int] = {
    "train.micro_batch": 0, "memory.resident_layers": -1, "memory.seq_tile_tokens": -1,
    "memory.offload_layers": -1, "memory.device_layers": -1, "memory.prefetch_depth": -1,
}
AUTO = "auto"
# the [train] keys a job record of an older version holds that [train] no longer has
TRAIN_KEYS_MOVED = tuple(k.partition(".")[2] for k in JOB_KEYS if k.startswith("train."))


def current(record: Mapping[str, Any]) -> dict[str, Any]:
    """`record` with its old keys under their current names (where both are present, the current one's value)."""
    out = {k: v for k, v in record.items() if k not in RENAMED}
    for old, new in RENAMED.items():
        if old in record:
            out.setdefault(new, record[old])
    return out


def job_key(key: str) -> str:
    """A job-file key ("section.key") under its current name."""
    return JOB_KEYS.get(key, key)


def job_setting(key: str, value: Any) -> tuple[str, Any]:
    """A job-file key ("section.key") and its value under their current name and spelling (an old key's
    "the plan decides" is "auto"), with a one-line warning where either changed."""
    if key not in JOB_KEYS:
        return key, value
    new = JOB_KEYS[key]
    if key in JOB_SENTINELS and type(value) is int and value == JOB_SENTINELS[key]:
        _log.warning("%s = %d is deprecated: call it %s = \"%s\"", key, value, new, AUTO)
        return new, AUTO
    _log.warning("%s is deprecated: call it %s", key, new)
    return new, value


def move_job_keys(doc: dict[str, Any]) -> list[str]:
    """Move a job file's keys of an older name to their current section and key (job_setting) in `doc`,
    the parsed file with its sections copied; returns the problems (a key set under both names, which is
    refused). A section that is not a table is left for the caller to report."""
    problems = []
    for old, new in JOB_KEYS.items():
        section, key = old.split(".")
        new_section, new_key = new.split(".")
        table, target = doc.get(section), doc.setdefault(new_section, {})
        if not (isinstance(table, dict) and key in table and isinstance(target, dict)):
            continue
        if new_key in target:
            problems.append(f"{old} and {new} are both set: {old} is the old name of {new}; keep only {new}")
            table.pop(key)
            continue
        target[new_key] = job_setting(old, table.pop(key))[1]
    return problems


def override_key(doc: dict[str, Any], key: str, value: Any) -> tuple[str, str, Any]:
    """A command-line override's (section, key, value) under their current names (warning where it used an
    old one); the file's value of that key under any other name is dropped from `doc`: the override wins."""
    name, value = job_setting(key, value)
    for other in [name] + [old for old, new in JOB_KEYS.items() if new == name]:
        section, _, field = other.partition(".")
        if other != name and isinstance(doc.get(section), dict):
            doc[section].pop(field, None)
    section, _, field = name.partition(".")
    return section, field, value


def train_record(train: Mapping[str, Any]) -> dict[str, Any]:
    """A job record's [train] section (the store keeps the last job's) without the keys that left [train]."""
    return {k: v for k, v in train.items() if k not in TRAIN_KEYS_MOVED}
