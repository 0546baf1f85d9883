"""Which of a job's step records (lines of metrics.jsonl) a step time is read from.

One rule for the launcher's summary and the benchmark harness's row, which must agree: a step
after which the workers wrote device-held units back to the store (a checkpoint's or the job
end's work, which no peer times) is left out while other steps remain.
"""

from __future__ import annotations

from typing import Any


def timed_steps(records: list[dict[str, Any]], skip: int) -> list[dict[str, Any]]:
    """The records after the first `skip` (start-up, warm-up), less the write-back steps unless
    nothing else would be left; [] when there is nothing after `skip`."""
    rest = records[skip:]
    return [r for r in rest if not r.get("write_back_s")] or rest


def write_backs(records: list[dict[str, Any]], skip: int) -> list[float]:
    """The write-back times of the records after the first `skip`, in order."""
    return [float(r["write_back_s"]) for r in records[skip:] if r.get("write_back_s")]
