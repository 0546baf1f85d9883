"""The docs name files that exist: every backticked repository path in docs/*.md and README.md.

A span is a repository path when it holds a "/" and either starts at a top-level entry of the
repository (`slidedp/...`, `tests/...`) or names a source or document file (`.py`, `.md`, ...);
`path:name` must name something that file defines or mentions. Run-directory paths (`runs/...`,
`checkpoints/...`) and bare file names (`core.py`, read beside the path before them) are not
checked.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
TOP = {p.name for p in ROOT.iterdir()} - {".git", ".venv", "runs"}
FILE_SUFFIXES = (".py", ".md", ".sh", ".toml", ".service", ".yml", ".yaml")
_SPAN = re.compile(r"`([^`\s]+)`")


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
