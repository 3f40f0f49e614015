"""The KV tiers benchmark runs end to end (on the tiny model: a smoke run, not a measurement)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.kv_tiers.redis_server import needs_redis


@pytest.mark.slow
@needs_redis
def test_kv_tiers_bench_reports_every_side_with_tier_hits(tiny_model, tmp_path):
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "benchmarks.kv_tiers_bench", "--model", tiny_model, "--dtype", "float32"]
    argv += ["--history", "150", "--turn-len", "16", "--out", str(out)]
    subprocess.run(argv, check=True, timeout=600)
    results = json.loads(out.read_text())
    summary = results["summary"]
    assert set(summary["ttft_median_s"]) == {"recompute", "host", "redis", "redis_second_group"}
    assert all(share == 1.0 for share in summary["same_first_tokens_as_recompute"].values())
    sides = results["sides"]
    assert sides["host"]["tiers"]["host"]["hit_tokens"] > 0
    assert sides["redis"]["tiers"]["redis"]["hit_tokens"] > 0
    # Every full block of every turn's prompt (but the last token's) comes from what the first group wrote.
    assert sides["redis_second_group"]["tiers"]["redis"]["hit_tokens"] == 4 * (160 + 176 + 192)
