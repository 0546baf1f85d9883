"""Print, one per line, the uv arguments that give `uv pip install` the package sources pip is configured with.

pip's configuration (its files and PIP_* variables, as `pip config list` reports them) names where packages
come from: an index, extra indexes, local wheel folders, constraints. uv reads none of it; scripts/setup.sh
hands it these. pip takes the best version across all its indexes, so uv is told to do the same.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

# pip's key -> uv's flag (keys as `pip config list` names them, after the section: "global.find-links")
FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
PRECEDENCE = {"global": 0, "install": 1, ":env:": 2}


def uv_arguments(listing: str) -> list[str]:
    """uv's arguments for `pip config list` output: lines like `global.find-links='/opt/wheels'` or
    `:env:.extra-index-url='a b'`; of two settings of one key, pip's precedence picks: a PIP_* variable
    over the install section over the global one."""
    found: dict[str, tuple[int, list[str]]] = {}
    for line in listing.splitlines():
        name, _, value = line.partition("=")
        section, key = name.split(".")[0], name.rpartition(".")[2]
        if key in FLAGS and section in PRECEDENCE and PRECEDENCE[section] >= found.get(key, (-1, []))[0]:
            found[key] = (PRECEDENCE[section], shlex.split(shlex.split(value)[0]) if value else [])
    args = ["--index-strategy", "unsafe-best-match"]
    for key, (_, values) in found.items():
        for v in values:
            args += [FLAGS[key], v]
    return args


def main() -> None:
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    print("\n".join(uv_arguments(out)))


if __name__ == "__main__":
    main()
