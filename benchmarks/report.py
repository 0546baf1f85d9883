"""Per-run reports: a short Markdown page and a plot beside each result JSON, and an index of them.

The harness writes `NAME.md` (one table per workload, SlideDP's ratio to each system, the
host-residence overhead against the same-kernel resident limit) and `NAME.png` (tokens/s per
system, one panel per workload) next to `NAME.json`, after every run and every merge.
For result files made elsewhere (or before this existed):

    python -m benchmarks.report benchmarks/results/NAME.json ...   # rewrite NAME.md and NAME.png
    python -m benchmarks.report --index benchmarks/results          # rewrite results/index.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.table import HEADLINE, add_ratios, format_table, group_rows, row_labels, workload_title

INDEX = "index.md"


def _gib(v: Any) -> str:
    return f"{v:.0f}" if isinstance(v, (int, float)) else "?"


def _headline(group: list[dict[str, Any]]) -> list[str]:
    """SlideDP's figures in one workload, in words: against its limit, and against every other row."""
    head = next((r for r in group if r.get("system") == HEADLINE and r.get("status") == "ok"), None)
    if head is None:
        return [f"SlideDP (`{HEADLINE}`, the default configuration) has no figure in this workload."]
    lines = [f"SlideDP (`{HEADLINE}`): {head['tokens_per_s']:,.0f} tokens/s."]
    if head.get("baseline") and head.get("vs_resident") is not None:
        ratio = head["vs_resident"]
        what = "host-residence overhead" if head["baseline"] == "resident_same_kernels" else "against"
        lines.append(f"{ratio:.2f}x the throughput of `{head['baseline']}`"
                     + (f" ({what} {1 - ratio:+.0%})" if what != "against" else "")
                     + ("." if what != "against" else " (no same-kernel resident row ran)."))
    others = [(r, name) for r, name in zip(group, row_labels(group)) if r is not head and r.get("slidedp_ratio") is not None]
    if others:
        lines.append("SlideDP / each: " + ", ".join(f"`{name}` {r['slidedp_ratio']:.2f}x" for r, name in others) + ".")
    return lines


def markdown(doc: dict[str, Any], plot_name: str | None = None, title: str = "") -> str:
    rows = doc.get("rows", [])
    add_ratios(rows)
    groups = group_rows(rows)
    commit = doc.get("git_commit")
    commit_text = ", ".join(str(c)[:12] for c in commit) if isinstance(commit, list) else str(commit or "?")[:12]
    out = [f"# {title or 'Benchmark run'}", "",
           f"{doc.get('date', '?')} on {doc.get('gpu') or '?'} ({doc.get('cpus') or '?'} CPUs, "
           f"{_gib(doc.get('host_ram_gib'))} GiB host memory), torch {doc.get('torch') or '?'}, "
           f"commit {commit_text}{'' if doc.get('complete', True) else ' (incomplete: the run was cut short)'}.", "",
           f"Command: `{doc.get('command', '?')}`", ""]
    sources = (doc.get("settings") or {}).get("merged_from")
    if sources:
        out += ["Merged from: " + "; ".join(f"`{s.get('command') or s.get('file')}`" for s in sources), ""]
    if plot_name:
        out += [f"![tokens/s per system]({plot_name})", ""]
    for key, group in groups.items():
        out += [f"## {workload_title(key)}", "", *_headline(group), "", format_table(group), ""]
    out += ["`vs resident`: tokens/s over the workload's resident baseline (the same-kernel GPU-resident limit "
            "`resident_same_kernels` where it ran); `SlideDP / this`: SlideDP's tokens/s (default configuration) "
            "over the row's. Each row's config says the math it trains (precision, clipping, exact or approximate).", ""]
    return "\n".join(out)


def plot(doc: dict[str, Any], path: Path) -> bool:
    """Tokens/s per system, one horizontal-bar panel per workload; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = doc.get("rows", [])
    add_ratios(rows)
    groups = group_rows(rows)
    height = max(len(g) for g in groups.values()) if groups else 1
    fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(6.5 * max(1, len(groups)), 0.45 * height + 1.6),
                             squeeze=False)
    for ax, (key, group) in zip(axes[0], groups.items()):
        names = row_labels(group)
        values = [float(r["tokens_per_s"]) if r.get("status") == "ok" and r.get("tokens_per_s") else 0.0 for r in group]
        systems = [str(r.get("system", "?")) for r in group]  # the colour is the system's, whatever its label
        colors = ["#d95f02" if n.startswith("slidedp") else "#7570b3" if n == "resident_same_kernels" else "#999999"
                  for n in systems]
        ys = list(range(len(group)))[::-1]
        ax.barh(ys, values, color=colors)
        top = max(values) if any(values) else 1.0
        for y, r, v in zip(ys, group, values):
            if v:
                label = f"{v:,.0f}" + (f"  (SlideDP {r['slidedp_ratio']:.2f}x)" if r.get("slidedp_ratio") and
                                       r.get("system") != HEADLINE else "")
            else:
                label = str(r.get("status", "?")).split(":")[0].split(" --")[0].split(" (")[0]
            ax.text(v + top * 0.01, y, label, va="center", fontsize=8)
        ax.set_yticks(ys, names, fontsize=9)
        ax.set_xlim(0, top * 1.45)
        ax.set_xlabel("tokens/s (higher is better)")
        ax.set_title(workload_title(key), fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle("tokens/s per system; in parentheses SlideDP's (default configuration) over the system's",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(json_path: Path, doc: dict[str, Any] | None = None, with_plot: bool = True) -> list[Path]:
    """NAME.md (and NAME.png) beside NAME.json; the paths written."""
    doc = doc if doc is not None else json.loads(json_path.read_text())
    png = json_path.with_suffix(".png")
    written = []
    if with_plot and plot(doc, png):
        written.append(png)
    md = json_path.with_suffix(".md")
    md.write_text(markdown(doc, png.name if png.is_file() else None, title=json_path.stem))
    written.append(md)
    return written


def write_index(folder: Path) -> Path:
    """folder/index.md: every report in the folder, newest first, with its workloads and date."""
    entries = []
    for md in sorted(folder.glob("*.md")):
        src = md.with_suffix(".json")
        if md.name == INDEX or not src.is_file():
            continue
        try:
            doc = json.loads(src.read_text())
        except (OSError, ValueError):
            continue
        titles = ", ".join(workload_title(k) for k in group_rows(doc.get("rows", [])))
        entries.append((str(doc.get("date", "")), f"- [{md.stem}]({md.name}) ({str(doc.get('date', '?'))[:10]}): {titles}"))
    lines = ["# Benchmark reports", "", "One page per result file (`python -m benchmarks.report --index` rewrites "
             "this list), newest first.", "",
             *((e for _, e in sorted(entries, reverse=True)) if entries else ["(none yet)"]), ""]
    path = folder / INDEX
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write NAME.md and NAME.png beside result files; or the folder's index.")
    p.add_argument("files", nargs="*", help="result JSON files of benchmarks.run")
    p.add_argument("--index", metavar="DIR", help="rewrite DIR/index.md from the reports in DIR")
    p.add_argument("--no-plot", action="store_true", help="Markdown only")
    args = p.parse_args(argv)
    if not args.files and not args.index:
        p.error("name result files and/or --index DIR")
    for f in args.files:
        for written in write(Path(f), with_plot=not args.no_plot):
            print(written)
    if args.index:
        print(write_index(Path(args.index)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
