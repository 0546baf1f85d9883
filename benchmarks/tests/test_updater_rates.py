"""benchmarks/updater_rates.py runs here with small sizes and says what the machine allows."""

from __future__ import annotations

import json
import os

from benchmarks import updater_rates
from slidedp.adamw import COMPILED
from slidedp.store.shm import SHM_DIR


def _own_segments() -> set[str]:
    return {e for e in os.listdir(SHM_DIR) if e.startswith("slidedp-rates-")}


def test_the_rates_benchmark_writes_every_row_and_what_the_kernel_allows(tmp_path):
    out = tmp_path / "rates.json"
    before = _own_segments()
    assert updater_rates.main(["--out", str(out), "--params", "1", "--chunk", "1", "--threads", "1",
                               "--reps", "1"]) == 0
    got = json.loads(out.read_text())
    assert "shmem_enabled" in got["thp"] and got["cuda"] in (True, False) and got["numba"] == COMPILED
    assert set(got["huge_page_bytes"]) == {"False", "True"}
    kernels = {"fused_whole", "fused_whole+shadow", "fused_whole clipped", "undo_redo", "undo_redo+shadow"}
    if COMPILED:
        kernels |= {"compiled", "compiled+shadow", "compiled clipped", "correction", "correction+shadow"}
    rows = got["rows"]
    assert {r["kernel"] for r in rows} == kernels
    assert len(rows) == len(kernels) * 4  # huge pages asked for or not, a copy stream beside or not
    assert all(r["g_params_per_s"] > 0 for r in rows)
    assert all("copy" in r and "copy_error" not in r for r in rows if r.get("copy"))
    assert sum(1 for r in rows if r.get("copy")) == len(kernels) * 2
    assert _own_segments() == before  # it removed its shared-memory segments
