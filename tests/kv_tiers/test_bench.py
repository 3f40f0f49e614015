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
    assert set(summary["ttft_median_s"]) == {"recompute", "device", "host", "redis", "redis_second_group"}
    assert set(summary["first_hit_ttft_s"]) == {"device", "host", "redis", "redis_second_group"}
    assert set(summary["vs_device_hit"]) == {"host", "redis", "redis_second_group"}
    assert all(share == 1.0 for share in summary["same_first_tokens_as_recompute"].values())
    sides = results["sides"]
    # The device side holds every history: no tiers, and every later turn finds all of its prompt's full blocks
    # but the last token's (turns 2 and 3 of 4 users: 160 and 176 tokens) in the device cache.
    assert sides["device"]["tiers"] == {}
    assert sides["device"]["device_hit_tokens"] == 4 * (160 + 176)
    assert summary["first_hit_ttft_s"]["host"] == round(sides["host"]["ttft"][1][0], 4)
    assert sides["host"]["tiers"]["host"]["hit_tokens"] > 0
    assert sides["redis"]["tiers"]["redis"]["hit_tokens"] > 0
    # Every full block of every turn's prompt (but the last token's) comes from what the first group wrote.
    assert sides["redis_second_group"]["tiers"]["redis"]["hit_tokens"] == 4 * (160 + 176 + 192)
