"""scripts/pip_sources.py: the package sources pip is configured with, as uv's arguments (scripts/setup.sh)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pip_sources.py"
spec = importlib.util.spec_from_file_location("pip_sources", SCRIPT)
pip_sources = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pip_sources)  # type: ignore[union-attr]


def test_every_source_pip_is_configured_with_reaches_uv():
    listing = "\n".join([
        ":env:.cert='/etc/ssl/certs/ca-certificates.crt'",
        ":env:.find-links='/opt/wheels'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'",
        "global.find-links='/srv/other'",
        "install.index-url='https://mirror.example/simple'",
        "global.index-url='https://pypi.org/simple'",
        "global.timeout='60'",
    ])
    assert pip_sources.uv_arguments(listing) == [
        "--index-strategy", "unsafe-best-match",
        "--find-links", "/opt/wheels",  # PIP_FIND_LINKS over the files' global.find-links
        "--constraint", "/etc/xdg/pip/constraints.txt",
        "--extra-index-url", "file:///opt/pypi/simple", "--extra-index-url", "file:///opt/pypi-more/simple",
        "--index-url", "https://mirror.example/simple",
    ]


def test_a_pip_without_configuration_leaves_uv_its_defaults():
    assert pip_sources.uv_arguments("") == ["--index-strategy", "unsafe-best-match"]
