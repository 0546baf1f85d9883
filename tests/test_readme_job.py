"""The job file the README shows is one SlideDP accepts: every section and key exists and every value is
valid; the only problems it has here are the model folder and data file this machine lacks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from slidedp.config import load_job
from slidedp.section import ConfigError

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readmes_job_file_is_valid_but_for_its_paths(tmp_path):
    blocks = re.findall(r"```toml\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 1, "the README shows one job file"
    job = tmp_path / "job.toml"
    job.write_text(blocks[0])
    with pytest.raises(ConfigError) as e:
        load_job(job)
    problems = [line.split(": ", 1)[1] for line in str(e.value).splitlines()]
    assert [p.split(":")[0] for p in problems] == ["model.path", "data.path"], problems
