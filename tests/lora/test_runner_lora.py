"""The runner with LoRA slots equals peft's PeftModel, each adapter and the base mixed in one batch."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidArgument
from services.worker.lora.manager import build_lora_manager
from services.worker.setup.build import create_runner, load_model
from tests.lora.adapters import peft_model, save_adapter
from tests.worker.tiny import hf_model, request, run_logits, save_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = save_tiny_model(str(tmp_path_factory.mktemp("base")))
    adapters = {
        "a": save_adapter(base, str(tmp_path_factory.mktemp("a")), seed=1, rank=8),
        "b": save_adapter(base, str(tmp_path_factory.mktemp("b")), seed=2, rank=4, targets=("q_proj", "v_proj")),
        "c": save_adapter(base, str(tmp_path_factory.mktemp("c")), seed=3, rank=16, alpha=8, rslora=True),
    }
    return base, adapters


def lora_runner(base: str, max_loras: int, max_rank: int = 16):
    loaded = load_model(base, dtype="float32", device="cpu", attention_backend="torch", cpu_kernels="torch")
    runner = create_runner(loaded, block_size=4, num_blocks=128)
    runner.lora = build_lora_manager(loaded.model, max_loras, max_loras, max_rank)
    return runner


def reference_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0, -1]


def test_mixed_batch_equals_peft(tiny):
    base, adapters = tiny
    runner = lora_runner(base, max_loras=3)
    g = torch.Generator().manual_seed(0)
    cases = [(None, 5), ("a", 9), ("b", 1), ("c", 13), ("a", 3), (None, 17)]
    requests, expected, next_block = [], {}, 0
    refs = {name: peft_model(base, path) for name, path in adapters.items()}
    refs[None] = hf_model(base)
    for i, (name, n) in enumerate(cases):
        prompt = torch.randint(0, 160, (n,), generator=g).tolist()
        blocks = list(range(next_block, next_block + 5))
        next_block += 5
        r = request(f"r{i}", prompt, blocks, 0, n)
        r.lora = None if name is None else (name, adapters[name])
        requests.append(r)
        expected[r.request_id] = reference_logits(refs[name], prompt)
    got = run_logits(runner, requests)
    for rid, logits in expected.items():
        torch.testing.assert_close(got[rid], logits, atol=1e-4, rtol=1e-4)
    # the adapters really change the output
    assert not torch.allclose(got["r1"], reference_logits(refs[None], requests[1].token_ids[:9]), atol=1e-2)


def test_lru_reloads_when_more_adapters_than_slots(tiny):
    base, adapters = tiny
    runner = lora_runner(base, max_loras=1)
    ref = peft_model(base, adapters["b"])
    prompt = [3, 1, 4, 1, 5]
    for i, name in enumerate(["a", "b", "a", "b"]):
        r = request(f"x{i}", prompt, [0, 1], 0, len(prompt))
        r.lora = (name, adapters[name])
        got = run_logits(runner, [r])
        if name == "b":
            torch.testing.assert_close(got[r.request_id], reference_logits(ref, prompt), atol=1e-4, rtol=1e-4)
    assert runner.lora.slots.num_loads == 4


def test_rank_over_the_limit_is_refused(tiny):
    base, adapters = tiny
    runner = lora_runner(base, max_loras=1, max_rank=8)
    r = request("big", [1, 2, 3], [0], 0, 3)
    r.lora = ("c", adapters["c"])
    with pytest.raises(InvalidArgument, match="over --max-lora-rank 8"):
        run_logits(runner, [r])
