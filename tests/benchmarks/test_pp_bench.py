"""benchmarks/pp_bench.py runs end to end on a tiny model: each stage reports a busy fraction of its run, with
micro-batches on and off."""

from __future__ import annotations

import json

import pytest

from benchmarks import pp_bench
from tests.worker.tiny import save_tiny_model, save_tiny_tokenizer


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_stages_report_how_busy_each_was(tmp_path):
    model = save_tiny_model(str(tmp_path / "model"), num_hidden_layers=4)
    save_tiny_tokenizer(model)
    out = tmp_path / "pp.json"
    pp_bench.main(["--model", model, "--batch-sizes", "1,4", "--steps", "4", "--rounds", "1", "--json", str(out)])
    result = json.loads(out.read_text())["result"]
    assert set(result) == {"pp1", "pp2-micro-on", "pp2-micro-off"} and result["pp1"]["1"]["stage_busy"] == []
    for variant in ("pp2-micro-on", "pp2-micro-off"):
        for batch in ("1", "4"):
            busy = result[variant][batch]["stage_busy"]
            assert len(busy) == 2 and all(0 < b < 1 for b in busy), busy
            assert result[variant][batch]["tok_s"] > 0
