"""--speculative-config: vLLM's JSON, checked at startup; a bad value is one clear line, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.common import config as cfg
from services.common.speculative import SpeculativeConfig, parse_speculative_config


def test_ngram_and_draft_model_configs_parse_with_vllm_defaults():
    assert parse_speculative_config("") is None
    ngram = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert ngram == SpeculativeConfig("ngram", 5, prompt_lookup_min=3, prompt_lookup_max=3)
    vllm_style = parse_speculative_config('{"model": "[ngram]", "num_speculative_tokens": 2}')
    assert vllm_style == SpeculativeConfig("ngram", 2, prompt_lookup_min=5, prompt_lookup_max=5)
    draft = parse_speculative_config(
        '{"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 4, "disable_by_batch_size": 8}'
    )
    assert (draft.method, draft.model, draft.num_speculative_tokens, draft.disable_by_batch_size) == (
        "draft_model",
        "/m/draft",
        4,
        8,
    )
    quantized = parse_speculative_config(
        '{"method": "draft_model", "model": "/m/draft.gguf", "num_speculative_tokens": 4, "quantization": "gguf"}'
    )
    assert quantized.quantization == "gguf" and draft.quantization == ""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{method: ngram}", "not JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of ngram, draft_model"),
        ('{"method": "ngram"}', "num_speculative_tokens must be given"),
        ('{"method": "ngram", "num_speculative_tokens": -1}', "non-negative integer"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "lookup": 1}', "unknown key 'lookup'"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "quantization": "gguf"}', "applies to method draft_model"),
        ('{"method": "draft_model", "model": "/d", "num_speculative_tokens": 2, "quantization": "q"}', "int8, gguf"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "<="),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs model"),
    ],
)
def test_bad_configs_are_refused_naming_the_problem(text, message):
    with pytest.raises(cfg.ConfigError, match="--speculative-config: .*" + message.replace("[", r"\[")):
        cfg.build_section(cfg.SchedulerConfig, environ={"KVGRID_SPECULATIVE_CONFIG": text})


def test_the_cli_refuses_an_unknown_method_at_startup_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "kvgrid.cli", "scheduler", "--speculative-config",
                           '{"method": "medusa", "num_speculative_tokens": 2}'],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert "--speculative-config: method must be one of ngram, draft_model, got 'medusa'" in proc.stderr
    assert "Traceback" not in proc.stderr
