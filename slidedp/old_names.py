"""Names older SlideDP versions wrote, and what they are called now: the one place that knows them.

Data on disk outlives a rename: a host's calibration cache, a run's metrics.jsonl, a job file.
Readers of such data pass its keys through here (`current` for records; `move_job_keys`,
`override_key` and `job_key` for job-file keys); nothing else spells an old name.
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
}


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


def move_job_keys(section: str, values: dict[str, Any]) -> list[str]:
    """Move a job file section's keys of an older name to their current one, each with a one-line
    warning; returns the problems (a key set under both names, which is refused)."""
    problems = []
    for key in [k for k in values if f"{section}.{k}" in JOB_KEYS]:
        old, new = f"{section}.{key}", JOB_KEYS[f"{section}.{key}"]
        if new.partition(".")[2] in values:
            problems.append(f"{old} and {new} are both set: {old} is the old name of {new}; keep only {new}")
            values.pop(key)
            continue
        _log.warning("%s is deprecated: call it %s", old, new)
        values[new.partition(".")[2]] = values.pop(key)
    return problems


def override_key(section: str, key: str, table: dict[str, Any]) -> str:
    """The current name of a command-line override's key (warning where it is an old one); the
    section's value under any other name of it is dropped: the override wins."""
    name = f"{section}.{key}"
    if name in JOB_KEYS:
        _log.warning("%s is deprecated: call it %s", name, JOB_KEYS[name])
        name = JOB_KEYS[name]
    for old in [o for o, new in JOB_KEYS.items() if new == name]:
        table.pop(old.partition(".")[2], None)
    return name.partition(".")[2]
