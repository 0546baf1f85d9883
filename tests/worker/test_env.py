"""The workers' environment: expandable allocator segments by default, the user's choice kept."""

from __future__ import annotations

from slidedp.launch.jobrun import worker_env


def test_expandable_segments_by_default(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("SLIDEDP_TEST_MARK", "kept")
    env = worker_env()
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["SLIDEDP_TEST_MARK"] == "kept"  # everything else is inherited


def test_the_users_allocator_setting_wins(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256")
    assert worker_env()["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:256"
