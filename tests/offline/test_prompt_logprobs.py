"""LLM.generate with prompt_logprobs (vLLM's shape: None first, then {token id: Logprob} per prompt token) equals
transformers' float32 log-softmax, prefilled in chunks, with a cached prefix, and preempted part way."""

from __future__ import annotations

import pytest
import torch

from kvgrid import LLM, SamplingParams
from tests.offline.conftest import TINY_OPTIONS, word_prompt
from tests.worker.tiny import hf_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def reference(tiny_model):
    return hf_model(tiny_model)


def check(reference, prompt: list[int], got: list, num_top: int) -> None:
    with torch.inference_mode():
        ref = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert got[0] is None and len(got) == len(prompt)
    for p in range(1, len(prompt)):
        row, token = ref[p - 1], prompt[p]
        top = row.topk(num_top).indices.tolist()
        assert set(got[p]) == {token, *top}
        assert got[p][token].rank == int((row > row[token]).sum()) + 1
        for token_id, logprob in got[p].items():
            assert abs(logprob.logprob - row[token_id].item()) < 1e-4
            special = {158: "<|im_end|>", 159: "<unk>"}
            assert logprob.decoded_token == special.get(token_id, f"t{token_id}")
        assert [got[p][t].rank for t in top] == list(range(1, num_top + 1))


def ids(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


def test_chunked_cached_and_preempted_prompts_score_like_transformers(tiny_model, reference):
    # 8 blocks of 16 tokens and chunks of 16: four 40-token prompts running to 80 tokens cannot all fit.
    llm = LLM(model=tiny_model, kv_cache_memory=8 * 8192, max_num_batched_tokens=16, **TINY_OPTIONS)
    prefix = ids(word_prompt(1, 33))
    llm.generate([prefix], SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.engine.scheduler.kv.pool.num_cached_free_blocks == 2  # its two full blocks, for the first prompt
    prompts = [prefix + ids(word_prompt(9, 7))] + [ids(word_prompt(i, 40)) for i in range(2, 5)]
    params = SamplingParams(max_tokens=40, ignore_eos=True, prompt_logprobs=3)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats().num_preemptions > 0
    assert outputs[0].num_cached_tokens == 0  # the cached prefix was computed again, to be scored
    for prompt, out in zip(prompts, outputs, strict=True):
        check(reference, prompt, out.prompt_logprobs, num_top=3)
        assert len(out.token_ids) == 40


def test_prompt_logprobs_are_checked(tiny_llm):
    with pytest.raises(ValueError, match="sampling.prompt_logprobs: at most 20"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1).to_proto()
    out = tiny_llm.generate(["t5"], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]
