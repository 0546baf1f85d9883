"""Logging with the process's role and rank in every line (plain lines: journald-friendly)."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname)s {tag} %(message)s"


def setup(role: str, rank: int | None = None, level: str | None = None) -> logging.Logger:
    """Configure the root logger once per process and return the role's logger."""
    tag = f"[{role}]" if rank is None else f"[{role} rank={rank}]"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT.format(tag=tag), datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level or os.environ.get("SLIDEDP_LOG_LEVEL", "INFO"))
    return logging.getLogger(f"slidedp.{role}")


def get(role: str) -> logging.Logger:
    return logging.getLogger(f"slidedp.{role}")
