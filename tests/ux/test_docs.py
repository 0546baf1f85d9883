"""docs/job-file.md stays in step with slidedp/config.py: every section, key and default, and nothing else."""

from __future__ import annotations

import dataclasses
import re
import tomllib

import pytest

from slidedp.config import SECTIONS

from pipeline.harness import ROOT

DOC = ROOT / "docs" / "job-file.md"
REQUIRED = "**required**"


def doc_tables(text: str) -> dict[str, dict[str, str]]:
    """{section: {key: default cell}} from the `## [section]` headings and their | key | default | meaning | tables."""
    tables: dict[str, dict[str, str]] = {}
    section = None
    for line in text.splitlines():
        head = re.fullmatch(r"## \[(\w+)\]", line.strip())
        if head:
            section = head.group(1)
            tables[section] = {}
        elif line.startswith("## "):
            section = None
        elif section and line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            key = re.fullmatch(r"`(\w+)`", cells[0])
            assert key, f"[{section}]: the key cell {cells[0]!r} is not a `key`"
            assert len(cells) >= 3 and cells[2], f"{section}.{key.group(1)}: no meaning given"
            tables[section][key.group(1)] = cells[1]
    return tables


def doc_default(cell: str):
    """The default a cell documents: **required**, or the first `code span` read as a TOML value."""
    if cell == REQUIRED:
        return dataclasses.MISSING
    code = re.match(r"`([^`]*)`", cell)
    assert code, f"default cell {cell!r} holds neither {REQUIRED} nor a `TOML value`"
    return tomllib.loads(f"v = {code.group(1)}")["v"]


TABLES = doc_tables(DOC.read_text())


def test_every_section_is_documented():
    assert list(TABLES) == list(SECTIONS)


@pytest.mark.parametrize("section", list(SECTIONS))
def test_keys_and_defaults_match_the_dataclasses(section):
    fields = {f.name: f for f in dataclasses.fields(SECTIONS[section])}
    documented = TABLES[section]
    assert list(documented) == list(fields), f"[{section}] keys in docs/job-file.md differ from slidedp/config.py"
    for key, f in fields.items():
        want = f.default
        got = doc_default(documented[key])
        assert type(got) is type(want) and got == want, (
            f"{section}.{key}: docs/job-file.md says {documented[key]!r}, slidedp/config.py says {want!r}")


def test_parser_sees_bad_tables():
    bad = doc_tables("## [x]\n| key | default | meaning |\n|---|---|---|\n| `a` | `1` | one |\n| `b` | 2 | two |\n")
    assert bad == {"x": {"a": "`1`", "b": "2"}}
    with pytest.raises(AssertionError, match="neither"):
        doc_default("2")
    assert doc_default('`""` (the stem)') == "" and doc_default("`1e-8`") == 1e-8 and doc_default("`false`") is False
