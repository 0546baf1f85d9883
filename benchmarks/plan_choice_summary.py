"""Issue 23's comparison of one (shape, batch)'s runs: the plan's choice against the micro-batches forced.

    python3 -m benchmarks.plan_choice_summary [--chosen MB] RUN.json [RUN.json ...]

Each RUN.json is one `benchmarks.run` output of `sessions/plan_choice.sh` (TAG-auto.json, TAG-m4.json,
a repeat TAG-m4-r2.json, TAG-resident.json), read with its logs beside it (RUN.logs/, as the call's
tarball returns them; a run folder recorded on another machine is looked up there). The runs are
listed in the order they finished. Runs of one plan can differ by more than the candidates do (on
Qwen3-8B at 8 x 2,048 the host's AdamW bounds the step and its rate varies from run to run), so the
forced micro-batches are also compared on the timed steps of all their runs pooled. --chosen names
the plan's choice where no first run (TAG-auto) is among the files: a call of forced runs only.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers.slidedp_run import read_metrics
from slidedp.step_records import timed_steps

_UPDATERS = re.compile(r"updaters ran AdamW at ([0-9.]+) G params/s")
_MEASURING = re.compile(r"measuring one decoder layer .*?: ([0-9.]+) s")


@dataclass(frozen=True)
class Run:
    """One SlideDP run of the comparison: what its plan was and the steps it timed."""
    name: str
    micro_batch: int
    device_layers: int
    predicted_s: float | None
    timed_s: tuple[float, ...]
    status: str
    updaters_gps: float | None  # the rate the launcher measured the updaters' AdamW at in this run
    blocks_measured_s: float | None  # a first plan of the shape measured its blocks in this long
    finished: str
    weighed: tuple[str, ...] = ()  # the plan's table of candidates, as the launcher printed it

    @property
    def first_run(self) -> bool:
        """train.micro_batch = 0 (TAG-auto): the plan chose."""
        return self.name.endswith("-auto")

    @property
    def median_s(self) -> float:
        return statistics.median(self.timed_s)


def _here(recorded: str, run_json: Path) -> Path:
    """A path the run recorded (on the device machine), under the logs folder beside RUN.json here."""
    path = Path(recorded)
    if path.exists():
        return path
    parts = path.parts
    at = next((i for i, part in enumerate(parts) if part.endswith(".logs")), None)
    if at is None:
        return path
    return run_json.parent / f"{run_json.stem}.logs" / Path(*parts[at + 1:])


def _weighed(log: str) -> tuple[str, ...]:
    """A plan's table of candidates, as its launcher printed it: up to the (blank) line after it."""
    at = log.find("micro-batches weighed")
    lines: list[str] = []
    for line in log[at:].splitlines() if at >= 0 else ():
        if not line.strip():
            break
        lines.append(line.strip())
    return tuple(lines)


def load(run_json: Path) -> tuple[list[Run], list[str]]:
    """The SlideDP runs of one output file, and a line for each row that is not one (a peer's, a failure)."""
    doc = json.loads(run_json.read_text())
    runs, other = [], []
    name = run_json.stem
    for row in doc.get("rows", []):
        if row.get("system") != "slidedp":
            step = f"{row['step_s']:.3f} s/step" if row.get("step_s") else "no step"
            other.append(f"{name}: {row.get('system')} {row.get('status')}, {step}")
            continue
        run_dir = _here(row["run_dir"], run_json) if row.get("run_dir") else None
        if not row.get("step_s") or run_dir is None or not (run_dir / "metrics.jsonl").exists():
            other.append(f"{name}: slidedp {row.get('status')}, no timed step")
            continue
        plan = json.loads((run_dir / "plan.json").read_text())
        timed = timed_steps(read_metrics(run_dir / "metrics.jsonl"), int(row["warmup"]))
        log_path = _here(row["log"], run_json) if row.get("log") else None
        log = log_path.read_text() if log_path and log_path.exists() else ""
        updaters, measuring = _UPDATERS.findall(log), _MEASURING.findall(log)
        runs.append(Run(name=name, micro_batch=int(plan["micro_batch"]), device_layers=int(plan.get("device_layers", 0)),
                        predicted_s=row.get("predicted_step_s"),
                        timed_s=tuple(float(r["step_s"]) for r in timed), status=str(row.get("status")),
                        updaters_gps=float(updaters[-1]) if updaters else None,
                        blocks_measured_s=float(measuring[0]) if measuring else None,
                        finished=str(doc.get("date", "")),
                        weighed=_weighed(log)))
    return runs, other


def pooled(runs: list[Run]) -> dict[int, tuple[float, int, int]]:
    """Per micro-batch: the median of every timed step of its runs, how many runs, how many steps."""
    steps: dict[int, list[float]] = {}
    count: dict[int, int] = {}
    for run in runs:
        steps.setdefault(run.micro_batch, []).extend(run.timed_s)
        count[run.micro_batch] = count.get(run.micro_batch, 0) + 1
    return {mb: (statistics.median(v), count[mb], len(v)) for mb, v in sorted(steps.items())}


def _run_line(i: int, run: Run) -> str:
    steps = run.timed_s
    predicted = (f"predicted {run.predicted_s:.3f} s, measured median {run.median_s:.3f} s, "
                 f"error {100 * (run.predicted_s / run.median_s - 1):+.1f}%" if run.predicted_s
                 else f"no prediction, measured median {run.median_s:.3f} s")  # a CPU run's plan
    return (f"{i}. {run.name:24s} micro_batch {run.micro_batch} ({run.device_layers} held): {predicted}; "
            f"{len(steps)} timed steps {min(steps):.3f}-{max(steps):.3f} s"
            + (f"; updaters {run.updaters_gps:.2f} G params/s" if run.updaters_gps else "")
            + (f"; measured the blocks in {run.blocks_measured_s} s" if run.blocks_measured_s else "")
            + ("" if run.status == "ok" else f" [{run.status.split(' (')[0]}]"))


def summary(runs: list[Run], other: list[str], chosen: int | None = None) -> list[str]:
    """The lines plan_choice.sh prints: each run, then the choice against the forced micro-batches."""
    runs = sorted(runs, key=lambda r: (r.finished, r.name))
    lines = [line for run in runs if run.first_run for line in run.weighed] + other
    lines += [_run_line(i, run) for i, run in enumerate(runs, 1)]
    first = next((r for r in runs if r.first_run), None)
    chosen = first.micro_batch if first else chosen
    forced = [r for r in runs if not r.first_run]
    if first and forced:  # the first run against each forced run on its own
        best = min(forced, key=lambda r: r.median_s)
        lines.append(f"chosen micro_batch {first.micro_batch} ran {first.median_s:.3f} s; best forced run "
                     f"{best.name} (micro_batch {best.micro_batch}) ran {best.median_s:.3f} s: "
                     f"{100 * (first.median_s / best.median_s - 1):+.1f}%")
    table = pooled(forced)
    if len(table) > 1 or any(n > 1 for _, n, _ in table.values()):
        lines.append("forced runs pooled by micro-batch (median of all their timed steps):")
        lines += [f"  micro_batch {mb}: {med:.3f} s ({n} run(s), {k} steps)" for mb, (med, n, k) in table.items()]
    if chosen is not None and chosen in table and len(table) > 1:
        best_mb = min(table, key=lambda mb: table[mb][0])
        lines.append(f"chosen micro_batch {chosen}, forced: {table[chosen][0]:.3f} s; best forced micro_batch {best_mb}: "
                     f"{table[best_mb][0]:.3f} s: {100 * (table[chosen][0] / table[best_mb][0] - 1):+.1f}%")
    elif chosen is not None and table and chosen not in table:
        lines.append(f"chosen micro_batch {chosen}: no forced run of it to pool")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="benchmarks.run outputs of one (shape, batch)")
    p.add_argument("--chosen", type=int, help="the plan's micro-batch, where no TAG-auto run is among the files")
    args = p.parse_args(argv)
    runs: list[Run] = []
    other: list[str] = []
    for path in args.runs:
        if not path.exists():  # an unmatched glob: no run of this (shape, batch) wrote its file
            other.append(f"{path}: no such file")
            continue
        found, rest = load(path)
        runs += found
        other += rest
    print("\n".join(summary(runs, other, args.chosen)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
