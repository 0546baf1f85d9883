"""The harness's table: ratios within each workload, and the printed (Markdown) table.

Ratios are only taken between rows of the same workload (model shape, batch, tokens per
sequence, ranks): a merge of runs at 8 and 32 sequences, or of two models, compares each row
with the rows of its own workload. In each workload:

- `vs_resident`: tokens/s over the baseline's, the first row that ran of BASELINES in that order
  (the same-kernel GPU-resident limit first). SlideDP's figure there is what keeping the state in
  host memory costs against training with the same kernels on the GPU (`baseline` names the row);
- `slidedp_ratio`: SlideDP's tokens/s (the first `slidedp` row that ran: the default configuration)
  over this row's: how many times this system's throughput SlideDP reaches.
"""

from __future__ import annotations

import math
from typing import Any

BASELINES = ("resident_same_kernels", "gpu_resident", "gpu_resident_chunked", "fsdp2")
HEADLINE = "slidedp"  # the default-configuration SlideDP row
COLUMNS = ("system", "config", "tokens/s", "step s", "vs resident", "SlideDP / this", "GPU peak GiB",
           "host RSS + shm GiB", "loss first -> last", "status")
_RIGHT = {2, 3, 4, 5, 6, 7, 8}
WORKLOAD_KEYS = ("shape", "batch", "seq", "gpus")


def workload_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(row.get(k) for k in WORKLOAD_KEYS)


def workload_title(key: tuple[Any, ...]) -> str:
    shape, batch, seq, gpus = key
    if shape is None:
        return "(workload not recorded)"
    gpu_text = f", {gpus} GPUs" if gpus and gpus > 1 else ", 1 GPU"
    return f"{shape}, {batch} x {seq:,} tokens/step{gpu_text}" if batch and seq else f"{shape}{gpu_text}"


def row_labels(group: list[dict[str, Any]]) -> list[str]:
    """Each row's system, and where a system has several rows in the workload (a session's forced
    variants), the items of its config the others do not share: `slidedp (plan.micro_batch=4)`."""
    items = [[c for c in str(r.get("config", "")).split(", ") if c] for r in group]
    labels = []
    for r, mine in zip(group, items):
        same = [set(i) for other, i in zip(group, items) if other.get("system") == r.get("system")]
        own = [c for c in mine if not all(c in s for s in same)] if len(same) > 1 else []
        own = [c for c in own if "=" in c] or own  # a setting names the variant better than its effect
        labels.append(str(r.get("system", "?")) + (f" ({', '.join(own)})" if own else ""))
    return labels


def group_rows(rows: list[dict[str, Any]]) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    """Rows by workload, in the order each workload first appears."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(workload_key(r), []).append(r)
    return groups


def ran(r: dict[str, Any]) -> bool:
    return r.get("status") == "ok" and bool(r.get("tokens_per_s"))


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Set vs_resident, baseline and slidedp_ratio on every row (None where a side did not run)."""
    for group in group_rows(rows).values():
        base = next((r for name in BASELINES for r in group if r.get("system") == name and ran(r)), None)
        head = next((r for r in group if r.get("system") == HEADLINE and ran(r)), None)
        for r in group:
            r["vs_resident"] = r["tokens_per_s"] / base["tokens_per_s"] if base and ran(r) else None
            r["baseline"] = base["system"] if base else None
            r["slidedp_ratio"] = head["tokens_per_s"] / r["tokens_per_s"] if head and ran(r) else None
            r.pop("vs_gpu_resident", None)  # the old name, in files written before the baseline changed


def _num(v: Any, fmt: str) -> str:
    return "" if v is None else format(v, fmt)


def _times(v: Any) -> str:
    return "" if v is None else format(v, ".2f") + "x"


def _secs(v: Any) -> str:
    return "" if v is None else format(v, ".2f" if v >= 1 else ".3g")


def status_text(row: dict[str, Any]) -> str:
    """The status, and for a failure the first line of its error (the rest is in the JSON and the log)."""
    status = str(row.get("status", "?"))
    if status != "ok" and not status.startswith(("skipped", "not run")) and row.get("error"):
        status += " -- " + str(row["error"]).strip().splitlines()[0]
    elif status == "ok" and row.get("note"):
        status += " -- " + str(row["note"])
    status = " ".join(status.split())
    return status if len(status) <= 140 else status[:137] + "..."


def loss_text(losses: list[float | None] | None) -> str:
    """The first and last step's loss: every system trains on the same batch, so they fall alike."""
    done = [x for x in losses or [] if x is not None and math.isfinite(x)]
    return f"{done[0]:.2f} -> {done[-1]:.2f}" if done else ""


def table_rows(rows: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    out = []
    for r in rows:
        step = _secs(r.get("step_s"))
        if step and r.get("optimizer_s") is not None:
            step += f" (optimizer {_secs(r['optimizer_s'])})"
        if step and r.get("predicted_step_s") is not None:
            step += f" (predicted {_secs(r['predicted_step_s'])})"
        if step and r.get("step_stat") == "mean":
            step += " (mean)"
        host = ""
        if r.get("host_rss_gib") is not None or r.get("shm_gib") is not None:
            host = f"{r.get('host_rss_gib') or 0:.1f} + {r.get('shm_gib') or 0:.1f}"
        out.append((
            str(r.get("system", "?")), str(r.get("config", "")), _num(r.get("tokens_per_s"), ",.0f"), step,
            _times(r.get("vs_resident")), _times(r.get("slidedp_ratio")), _num(r.get("gpu_peak_gib"), ".1f"), host,
            loss_text(r.get("losses")), status_text(r),
        ))
    return out


def format_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table (pastes into docs as is)."""
    body = table_rows(rows)
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(COLUMNS)]

    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.rjust(w) if i in _RIGHT else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if i in _RIGHT else "-" * (w + 2) for i, w in enumerate(widths)) + "|"
    return "\n".join([line(COLUMNS), sep, *(line(b) for b in body)])
