"""Names older SlideDP versions wrote, and what they are called now: the one place that knows them.

Data on disk outlives a rename: a host's calibration cache, a run's metrics.jsonl, a job file.
Readers of such data pass its keys through here (`current`, `job_key`); nothing else spells an
old name.
"""

from __future__ import annotations

from typing import Any, Mapping

# record keys ("gpu" became "device" where it means the training device)
RENAMED: dict[str, str] = {
    # a host's calibration cache (planner/calibration.py)
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


def old_job_keys(key: str) -> list[str]:
    """The older names of a current job-file key."""
    return [old for old, new in JOB_KEYS.items() if new == key]


def deprecation(key: str) -> str:
    """The one-line warning for a job-file key of an older name."""
    return f"{key} is deprecated: call it {job_key(key)}"
