"""The docs name files that exist: every backticked repository path in docs/*.md and README.md, and
every relative Markdown link in them and in benchmarks/RESULTS.md.

A span is a repository path when it holds a "/" and either starts at a top-level entry of the
repository (`slidedp/...`, `tests/...`) or names a source or document file (`.py`, `.md`, ...);
`path:name` must name something that file defines or mentions. Run-directory paths (`runs/...`,
`checkpoints/...`) and bare file names (`core.py`, read beside the path before them) are not
checked. A link `[text](target)` that is not a URL must name a file or folder relative to the
document, and its `#anchor`, where it has one, a heading of the Markdown file it names (as GitHub
makes a heading's anchor).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
TOP = {p.name for p in ROOT.iterdir()} - {".git", ".venv", "runs"}
FILE_SUFFIXES = (".py", ".md", ".sh", ".toml", ".service", ".yml", ".yaml")
_SPAN = re.compile(r"`([^`\s]+)`")
LINKED = DOCS + [ROOT / "benchmarks" / "RESULTS.md"]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def repo_paths(text: str) -> list[tuple[int, str, str | None]]:
    """(line, path, name after ':' or None) of every backticked repository path in a document."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for span in _SPAN.findall(line):
            path, _, name = span.rstrip(".,;").partition(":")
            if "/" not in path or path.startswith(("/", "~", "./", "../")) or re.search(r"[<>*{}$=()\[\]]", path):
                continue
            if path.split("/")[0] in TOP or path.endswith(FILE_SUFFIXES):
                out.append((n, path, None if not name or name.isdigit() else name))
    return out


def test_the_guard_sees_paths_and_leaves_run_directories_alone():
    text = "`slidedp/store/client.py`, `store/rings.py`, `launch/planning.py:plan_job`, `runs/tiny/`, `core.py`"
    assert repo_paths(text) == [(1, "slidedp/store/client.py", None), (1, "store/rings.py", None),
                                (1, "launch/planning.py", "plan_job")]


def test_every_path_the_docs_name_exists():
    missing = []
    for doc in DOCS:
        for n, path, name in repo_paths(doc.read_text()):
            target = ROOT / path
            where = f"{doc.relative_to(ROOT)}:{n}: `{path}`"
            if not target.exists():
                missing.append(f"{where} does not exist")
            elif name and target.is_file() and not re.search(rf"\b{re.escape(name)}\b", target.read_text()):
                missing.append(f"{where} does not mention {name}")
    assert missing == []


def relative_links(text: str) -> list[tuple[int, str, str]]:
    """(line, path, anchor) of every Markdown link in a document that is not a URL; fenced code and
    inline code spans are not read. An anchor alone (`#section`) has the path ""."""
    text = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for target in _LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            out.append((n, path, anchor))
    return out


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation but "-" and "_"
    dropped, spaces made "-"; a repeated heading gets "-1", "-2", ..."""
    out: set[str] = set()
    count: dict[str, int] = {}
    for line in _FENCE.sub("", markdown).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = count.get(slug, 0)
        out.add(f"{slug}-{n}" if n else slug)
        count[slug] = n + 1
    return out


def test_the_link_guard_reads_links_and_anchors():
    text = "[a](docs/x.md#one-two) [b](https://x.org) `[c](y.md)` [d](#top)\n```\n[e](z.md)\n```\n"
    assert relative_links(text) == [(1, "docs/x.md", "one-two"), (1, "", "top")]
    assert anchors("# One: two\n## The planner's runs\n## Sizing /dev/shm\n## A\n## A\n") == {
        "one-two", "the-planners-runs", "sizing-devshm", "a", "a-1"}


def test_every_relative_link_resolves():
    broken = []
    for doc in LINKED:
        for n, path, anchor in relative_links(doc.read_text()):
            target = (doc.parent / path).resolve() if path else doc
            where = f"{doc.relative_to(ROOT)}:{n}: {path}{'#' + anchor if anchor else ''}"
            if not target.exists():
                broken.append(f"{where}: no such file")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target.read_text()):
                broken.append(f"{where}: no such heading")
    assert broken == []
