"""The launcher's own start: it imports no torch for a job on SlideDP's own layers. Every job's launcher
starts before any daemon or worker, so its imports are on the path to the first step; torch's import is
about a second and a half of CPU, which the daemons and workers (each importing torch themselves) wait
for. A model folder's config is read through transformers, which imports torch: that path keeps it."""

from __future__ import annotations

import subprocess
import sys

from pipeline.harness import TINY


def test_the_launcher_plans_a_native_job_without_importing_torch(tmp_path):
    code = (
        "import sys\n"
        "from slidedp.launch import cli\n"
        "assert 'torch' not in sys.modules, 'importing the launcher imported torch'\n"
        "try:\n"
        f"    cli.main([{str(TINY)!r}, '--plan'])\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "print('torch imported' if 'torch' in sys.modules else 'no torch')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "micro_batch=2" in proc.stdout  # it did plan the job
    assert proc.stdout.strip().endswith("no torch"), proc.stdout[-2000:]
