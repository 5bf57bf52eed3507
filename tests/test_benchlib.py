"""The benchmarks' shared harness (worldcup_cli.benchlib): its small pure parts."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from worldcup_cli import benchlib


def test_free_socket_is_tcp_on_loopback_with_a_port() -> None:
    sock = benchlib.free_socket()
    try:
        host, port = sock.getsockname()
        assert host == "127.0.0.1" and port > 0
        assert sock.proto == socket.IPPROTO_TCP  # asyncio sets TCP_NODELAY only then
    finally:
        sock.close()


def test_percentile_picks_the_nearest_rank() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert benchlib.percentile(values, 0) == 1.0
    assert benchlib.percentile(values, 50) == 3.0
    assert benchlib.percentile(values, 100) == 5.0
    assert benchlib.percentile([], 50) != benchlib.percentile([], 50)  # nan


def test_prompts_are_distinct_with_and_without_articles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLDCUP_DATA_DIR", str(tmp_path))
    assert benchlib.news_articles(4) == []  # no data file
    fallback = benchlib.news_prompts([], 20)
    assert len(set(fallback)) == 20
    articles = ["word " * 500 + "one", "text " * 500 + "two"]
    prompts = benchlib.news_prompts(articles, 3)
    assert len(set(prompts)) == 3 and prompts[0].startswith("word word")
    assert all(len(p) <= 400 + len(" (continued 2)") for p in prompts)


def test_wave_stats_sums_tokens_and_takes_medians() -> None:
    results = [
        {"num_tokens": 64, "timing": {"time_to_first_token_seconds": 0.1, "tokens_per_second": 10}},
        {
            "num_tokens": 64,
            "timing": {"time_to_first_token_seconds": None, "tokens_per_second": 30},
        },
    ]
    stats = benchlib.wave_stats(2, 4.0, results)
    assert stats["tokens"] == 128 and stats["tokens_per_s"] == 32.0
    assert stats["ttft_median_s"] == 0.1 and stats["per_sequence_tokens_per_s"] == 20.0
