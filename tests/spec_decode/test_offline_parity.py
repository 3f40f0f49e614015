"""Speculation changes no greedy float32 token: the in-process engine on a tiny random Llama, with and without.

The prompts repeat short phrases and the tiny model falls into loops of its own, so n-gram proposals are
accepted often (the test checks that they were): the accepted path, the rejected path and the bonus token
all run. A pool too small for all 200 requests at once makes the scheduler preempt mid-speculation.
"""

from __future__ import annotations

import pytest

from kvgrid import LLM, SamplingParams
from tests.offline.conftest import TINY_OPTIONS, tiny_model  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(300)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def repetitive_batch(n: int = 200) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts, params = [], []
    for i in range(n):
        phrase = [5 + (i * 7 + j * 3) % 40 for j in range(1 + i % 5)]
        prompts.append((phrase * 8)[: 2 + (i * 11) % 40])
        params.append(SamplingParams(max_tokens=1 + (i * 5) % 48, ignore_eos=True))
    return prompts, params


@pytest.fixture(scope="module")
def reference(tiny_model):  # noqa: F811
    prompts, params = repetitive_batch()
    llm = LLM(model=tiny_model, kv_cache_memory="8MiB", **TINY_OPTIONS)
    return [r.token_ids for r in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("cpu_kernels", ["native", "torch"])
def test_200_greedy_requests_with_preemption_equal_those_without_speculation(tiny_model, reference, cpu_kernels):  # noqa: F811
    # Blocks of 4 tokens, 40 of them: proposals cross block ends and the pool runs dry.
    options = {**TINY_OPTIONS, "block_size": 4, "kv_cache_memory": 40 * 2048}
    llm = LLM(model=tiny_model, speculative_config=NGRAM, cpu_kernels=cpu_kernels, **options)
    prompts, params = repetitive_batch()
    results = llm.generate(prompts, params, use_tqdm=False)
    assert [r.token_ids for r in results] == reference
    assert llm.stats().num_preemptions > 0
    stats = llm.engine.core.runner.spec.stats
    assert stats.num_accepted_tokens > 100 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_pos[3] > 0  # whole drafts were accepted, so bonus tokens were emitted
    assert llm.engine.scheduler.kv.pool.num_used_blocks == 0


def test_requests_that_do_not_speculate_mix_with_those_that_do(tiny_model):  # noqa: F811
    """Logprobs and penalties are computed per token as before; their requests simply propose nothing."""
    prompts, _ = repetitive_batch(12)
    params = [
        SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2 if i % 3 == 0 else 0,
                       repetition_penalty=1.3 if i % 3 == 1 else 1.0)
        for i in range(12)
    ]  # fmt: skip
    plain = LLM(model=tiny_model, kv_cache_memory="8MiB", **TINY_OPTIONS).generate(prompts, params, use_tqdm=False)
    spec = LLM(model=tiny_model, kv_cache_memory="8MiB", speculative_config=NGRAM, **TINY_OPTIONS)
    results = spec.generate(prompts, params, use_tqdm=False)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    for a, b in zip(results, plain, strict=True):
        if b.logprobs:
            assert [e.logprob for e in a.logprobs] == pytest.approx([e.logprob for e in b.logprobs], abs=1e-5)
    assert spec.engine.core.runner.spec.stats.num_accepted_tokens > 0


def test_seeded_sampling_with_speculation_is_reproducible(tiny_model):  # noqa: F811
    prompts, _ = repetitive_batch(16)
    params = [SamplingParams(max_tokens=32, temperature=0.02, seed=100 + i, ignore_eos=True) for i in range(16)]
    spec = LLM(model=tiny_model, kv_cache_memory="8MiB", speculative_config=NGRAM, **TINY_OPTIONS)
    first = [r.token_ids for r in spec.generate(prompts, params, use_tqdm=False)]
    again = [r.token_ids for r in spec.generate(prompts[::-1], params[::-1], use_tqdm=False)][::-1]
    assert first == again
    assert spec.engine.core.runner.spec.stats.num_accepted_tokens > 0


@pytest.fixture(scope="module")
def tinier_draft(tiny_model, tmp_path_factory):  # noqa: F811
    """A one-layer random Llama over the tiny target's vocabulary (its tokenizer)."""
    from tests.worker.tiny import save_tiny_model

    path = str(tmp_path_factory.mktemp("tinier-draft"))
    shape = dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    return save_tiny_model(path, seed=1, max_position_embeddings=128, **shape)


@pytest.mark.parametrize("draft", ["tinier", "target", "target-int8"])
def test_draft_model_greedy_with_preemption_equals_no_speculation(tiny_model, tinier_draft, reference, draft):  # noqa: F811
    """The tinier random draft is mostly rejected; the target as its own draft is always accepted, so the draft's
    cache lags a token after each step and must catch up (a wrong draft K/V would show as rejections). The
    target's own weights quantized to int8 as the draft (the config's ``quantization``) agree with it mostly."""
    config = {"method": "draft_model", "model": tinier_draft if draft == "tinier" else tiny_model}
    if draft == "target-int8":
        config["quantization"] = "int8"
    options = {**TINY_OPTIONS, "block_size": 4, "kv_cache_memory": 40 * 2048}
    llm = LLM(model=tiny_model, speculative_config={**config, "num_speculative_tokens": 3}, **options)
    prompts, params = repetitive_batch()
    assert [r.token_ids for r in llm.generate(prompts, params, use_tqdm=False)] == reference
    assert llm.stats().num_preemptions > 0
    stats = llm.engine.core.runner.spec.stats
    if draft == "target":
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 1000
    elif draft == "target-int8":
        assert stats.num_draft_tokens / 2 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert llm.engine.core.runner.spec.proposer.runner.model.layers[0].mlp.gate_up_proj.packed is not None
    else:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens / 4


def test_a_draft_with_another_vocabulary_is_refused_at_startup(tiny_model, tmp_path):  # noqa: F811
    from services.worker.setup.loader import ModelLoadError
    from tests.worker.tiny import save_tiny_model

    other = save_tiny_model(str(tmp_path), vocab_size=96, max_position_embeddings=128)
    config = {"method": "draft_model", "model": other, "num_speculative_tokens": 2}
    with pytest.raises(ModelLoadError, match="the draft must share the target's tokenizer"):
        LLM(model=tiny_model, speculative_config=config, kv_cache_memory="8MiB", **TINY_OPTIONS)


@pytest.mark.slow  # the Triton interpreter: minutes on a loaded 2-core machine
def test_the_triton_backend_verifies_proposals_like_the_torch_one(tiny_model):  # noqa: F811
    """Verify rows through the Triton paged-attention kernels (the interpreter on CPU, see tests/conftest.py)."""
    prompts, params = repetitive_batch(12)
    options = {**TINY_OPTIONS, "kv_cache_memory": "8MiB", "block_size": 4}
    plain = LLM(model=tiny_model, cpu_kernels="torch", **options).generate(prompts, params, use_tqdm=False)
    spec = LLM(model=tiny_model, attention_backend="triton", cpu_kernels="torch", speculative_config=NGRAM, **options)
    results = spec.generate(prompts, params, use_tqdm=False)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    assert spec.engine.core.runner.spec.stats.num_accepted_tokens > 0
