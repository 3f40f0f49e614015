"""benchmarks/lora_bench.py runs end to end (on a tiny random Llama) and writes both sides and their ratios."""

from __future__ import annotations

import json
import sys

from benchmarks import lora_bench
from tests.worker.tiny import save_tiny_model


def test_lora_bench_writes_both_sides(tmp_path, monkeypatch):
    model = save_tiny_model(str(tmp_path / "model"), max_position_embeddings=256)
    out = tmp_path / "lora_bench.json"
    flags = ["--model", model, "--requests", "4", "--adapters", "2", "--rank", "4", "--context", "8"]
    flags += ["--steps", "2", "--rounds", "1", "--threads", "1", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["lora_bench", *flags])
    lora_bench.main()
    result = json.loads(out.read_text())
    assert result["benchmark"] == "lora_bench" and result["adapters"] == 2
    for side in ("base", "lora"):
        assert result["summary"][side]["decode_step_ms"] > 0 and result["summary"][side]["prefill_ms"] > 0
    assert result["lora_over_base"]["decode_step_ms"] > 0
