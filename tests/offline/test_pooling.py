"""``LLM.embed`` and ``LLM.encode`` (``runner="pooling"``) in float32: transformers' last hidden states pooled the
same way, prompts of mixed lengths in one call, chunked prefill; and the refusals both ways."""

from __future__ import annotations

import pytest
import torch

from kvgrid import LLM, EmbeddingRequestOutput, PoolingParams, PoolingRequestOutput
from tests.offline.conftest import TINY_OPTIONS, word_prompt
from tests.pooling.conftest import PooledReference

LENGTHS = [1, 5, 33, 70, 12]


@pytest.fixture(scope="module")
def pooling_llm(tiny_model):
    threads = torch.get_num_threads()
    options = dict(TINY_OPTIONS, max_num_batched_tokens=32)  # the longer prompts take several steps
    yield LLM(model=tiny_model, kv_cache_memory="8MiB", runner="pooling", pooling_type="cls", **options)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(tiny_model) -> PooledReference:
    return PooledReference(tiny_model)


@pytest.mark.parametrize("params", [None, PoolingParams("mean", normalize=False), PoolingParams("last", dimensions=8)])
def test_embed_equals_transformers_pooled(pooling_llm, reference, params):
    prompts = [word_prompt(i, n) for i, n in enumerate(LENGTHS)]
    outputs = pooling_llm.embed(prompts, params, use_tqdm=False)
    assert all(isinstance(o, EmbeddingRequestOutput) and o.finished for o in outputs)
    p = params or PoolingParams("cls", normalize=True)  # the LLM's defaults: --pooling-type cls, --normalize
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = reference.ids(prompt)
        assert out.prompt_token_ids == ids
        expected = reference.pool(ids, p.pooling_type, p.normalize is not False, p.dimensions or 0)
        got = torch.tensor(out.outputs.embedding)
        assert out.outputs.hidden_size == expected.shape[0]
        assert torch.nn.functional.cosine_similarity(got, expected, dim=0).item() >= 0.9999
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_encode_gives_tensors_and_token_id_prompts(pooling_llm, reference):
    ids = reference.ids(word_prompt(3, 20))
    (by_text,) = pooling_llm.encode(word_prompt(3, 20), use_tqdm=False)
    (by_ids,) = pooling_llm.encode(ids, use_tqdm=False)
    assert isinstance(by_text, PoolingRequestOutput) and by_text.outputs.data.dtype == torch.float32
    assert torch.equal(by_text.outputs.data, by_ids.outputs.data)
    torch.testing.assert_close(by_ids.outputs.data, reference.pool(ids, "cls", True), atol=1e-4, rtol=1e-4)
    assert pooling_llm.engine.scheduler.kv.pool.num_used_blocks == 0


def test_refusals(pooling_llm, tiny_llm):
    with pytest.raises(ValueError, match="--runner pooling"):
        pooling_llm.generate("t5 t6")
    with pytest.raises(ValueError, match="--runner generate"):
        tiny_llm.embed("t5 t6")
    with pytest.raises(ValueError, match="hidden size 64"):
        pooling_llm.embed("t5", PoolingParams(dimensions=65))
    with pytest.raises(ValueError, match="pooling_type"):
        pooling_llm.embed("t5", PoolingParams("max"))
