"""Offline ``LLM.generate(..., lora_request=LoRARequest(...))`` with --max-loras 2 and four adapters in use: every
request completes, equal to peft's PeftModel, and an adapter the worker cannot serve is refused up front."""

from __future__ import annotations

import json
import pathlib

import pytest

from kvgrid import LLM, LoRARequest, SamplingParams
from tests.lora.conftest import MAX_TOKENS, prompt_ids


@pytest.fixture(scope="module")
def llm(tiny_lora):
    return LLM(
        model=tiny_lora.base,
        dtype="float32",
        kv_cache_memory="16MiB",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        num_threads=1,
    )


def test_four_adapters_over_two_slots_equal_peft(llm, tiny_lora):
    names = [None, "sql", "chat", "math", "code"]
    prompts, loras, expected = [], [], []
    for i in range(10):
        name = names[i % len(names)]
        prompts.append(prompt_ids(i))
        loras.append(None if name is None else LoRARequest(name, names.index(name), tiny_lora.adapters[name]))
        expected.append(tiny_lora.greedy(name, prompts[-1]))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    got = [list(o.token_ids) for o in outputs]
    assert got == expected
    assert len({tuple(e) for e in expected[:5]}) == 5  # each adapter (and the base) answers its own way


def test_adapter_over_the_rank_limit_is_refused(llm, tiny_lora, tmp_path):
    config = json.loads(pathlib.Path(tiny_lora.adapters["sql"], "adapter_config.json").read_text())
    config["r"] = 64
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="over --max-lora-rank 16"):
        llm.generate([prompt_ids(0)], lora_request=LoRARequest("big", 9, str(tmp_path)), use_tqdm=False)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate([prompt_ids(0)], lora_request=LoRARequest("none", 9, str(tmp_path / "nowhere")), use_tqdm=False)
