"""LLM.generate / chat on a tiny random model: order, batching, preemption, stop strings, logprobs, errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvgrid import LLM, SamplingParams
from tests.offline.conftest import TINY_OPTIONS, word_prompt

pytestmark = pytest.mark.timeout(300)

NUM_PROMPTS = 200


def mixed_batch() -> tuple[list, list[SamplingParams]]:
    """200 prompts of 1..40 tokens (text and token ids mixed), each running to its own length."""
    prompts, params = [], []
    for i in range(NUM_PROMPTS):
        text = word_prompt(i, 1 + (i * 7) % 40)
        prompts.append(text if i % 3 else [int(w[1:]) for w in text.split()])
        params.append(SamplingParams(max_tokens=1 + (i * 5) % 24, ignore_eos=True))
    return prompts, params


@pytest.fixture(scope="module")
def batch_results(tiny_llm):
    prompts, params = mixed_batch()
    return tiny_llm.generate(prompts, params, use_tqdm=False)


def test_200_prompts_of_mixed_lengths_finish_in_order(tiny_llm, batch_results):
    prompts, params = mixed_batch()
    assert len(batch_results) == NUM_PROMPTS
    for prompt, p, out in zip(prompts, params, batch_results, strict=True):
        expected_ids = prompt if isinstance(prompt, list) else [int(w[1:]) for w in prompt.split()]
        assert out.prompt_token_ids == expected_ids
        assert out.prompt == (prompt if isinstance(prompt, str) else None)
        assert out.num_prompt_tokens == len(expected_ids)
        assert len(out.token_ids) == out.num_completion_tokens == p.max_tokens
        assert out.finish_reason == "length"
        assert out.text == "".join(f" t{t}" for t in out.token_ids if t < 158)  # 158, 159: special tokens
    # Batching changes nothing: a sample of them, one at a time.
    for i in range(0, NUM_PROMPTS, 40):
        alone = tiny_llm.generate(prompts[i], params[i], use_tqdm=False)[0]
        assert alone.token_ids == batch_results[i].token_ids, i
    assert tiny_llm.engine.scheduler.kv.pool.num_used_blocks == 0


def test_a_cache_too_small_for_all_preempts_and_changes_nothing(tiny_model, batch_results):
    # 12 blocks of 16 tokens: one max-length sequence (128 tokens) fits, 200 requests at once do not.
    small = LLM(model=tiny_model, kv_cache_memory=12 * 8192, **TINY_OPTIONS)
    assert small.engine.scheduler.kv.pool.num_blocks == 12
    prompts, params = mixed_batch()
    results = small.generate(prompts, params, use_tqdm=False)
    assert small.stats().num_preemptions > 0
    assert [r.token_ids for r in results] == [r.token_ids for r in batch_results]
    assert [r.text for r in results] == [r.text for r in batch_results]


def test_stop_strings_end_the_text_and_free_the_request(tiny_llm):
    free = tiny_llm.generate("t5 t6 t7", SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    words = free.text.split()
    stop = " " + words[3]  # the fourth generated word, with its leading space
    out = tiny_llm.generate("t5 t6 t7", SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop]), use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.text == " " + " ".join(words[:3])
    assert out.token_ids == free.token_ids[:4]  # up to and including the token that completed the stop string
    scheduler = tiny_llm.engine.scheduler
    assert (scheduler.num_running, scheduler.num_waiting, scheduler.kv.pool.num_used_blocks) == (0, 0, 0)


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_llm):
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    alone = tiny_llm.generate("t8 t9", params, use_tqdm=False)[0]
    others = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    batch = tiny_llm.generate(["t1 t2 t3", "t8 t9", "t4"], [others, params, others], use_tqdm=False)
    assert batch[1].token_ids == alone.token_ids


def test_logprobs_name_each_token(tiny_llm):
    out = tiny_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.logprobs) == 4
    for token_id, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token_id and lp.token == f"t{token_id}"
        assert len(lp.top) == 3 and lp.top[0].logprob >= lp.logprob  # greedy: the best one was taken
        assert lp.top[0].token_id == token_id
    plain = tiny_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert plain.logprobs is None and plain.token_ids == out.token_ids


def test_chat_uses_the_model_chat_template(tiny_llm):
    conversation = [{"role": "system", "content": "t7"}, {"role": "user", "content": "t8 t9"}]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    (chat,) = tiny_llm.chat(conversation, params, use_tqdm=False)
    # "t2 <content> t3 " per turn, then the generation prompt t4
    assert chat.prompt_token_ids == [2, 7, 3, 2, 8, 9, 3, 4]
    assert chat.token_ids == tiny_llm.generate([chat.prompt_token_ids], params, use_tqdm=False)[0].token_ids
    two = tiny_llm.chat([conversation, conversation[1:]], params, use_tqdm=False)
    assert two[0].token_ids == chat.token_ids and two[1].prompt_token_ids == [2, 8, 9, 3, 4]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(top_p=1.5), "sampling.top_p: must be in [0, 1], got 1.5"),
        (dict(temperature=-0.5), "sampling.temperature: must be in [0, 100], got -0.5"),
        (dict(max_tokens=4, min_tokens=9), "sampling.min_tokens: 9 is more than max_tokens (4)"),
        (dict(stop=[""]), "sampling.stop[0]: must not be empty"),
        (dict(logprobs=21), "sampling.logprobs: at most 20, got 21"),
        (dict(max_tokens=-1), "sampling.max_tokens: must be >= 0, got -1"),
    ],
)
def test_sampling_params_are_checked_with_the_frontend_messages(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == message


def test_bad_requests_raise_value_error_before_anything_runs(tiny_llm):
    steps = tiny_llm.stats().num_steps
    cases = [
        (["t5", "t1 " * 130], None, "prompt 1: prompt: the prompt has 130 tokens but the model allows at most 128"),
        ([[5, 6], [5, 999]], None, "prompt 1: prompt_token_ids[1]: token id 999 is outside the vocabulary"),
        (["t5"], SamplingParams(max_tokens=500), "prompt 0: sampling.max_tokens: 500 exceeds the model's maximum"),
        (["t5"], SamplingParams(top_k=1000), "prompt 0: sampling.top_k: must be -1, 0 (no cut) or up to 160"),
        (["t5", "t6"], [SamplingParams()], "sampling_params: 1 given for 2 prompts"),
    ]
    for prompts, params, message in cases:
        with pytest.raises(ValueError) as info:
            tiny_llm.generate(prompts, params, use_tqdm=False)
        assert str(info.value).startswith(message), str(info.value)
    with pytest.raises(ValueError, match=r"prompt 0: messages\[0\].role: unknown role 'robot'"):
        tiny_llm.chat([{"role": "robot", "content": "t5"}], use_tqdm=False)
    assert tiny_llm.stats().num_steps == steps


def test_unknown_and_bad_options_are_refused(tiny_model):
    with pytest.raises(TypeError, match="unknown option.*max_num_sequences"):
        LLM(model=tiny_model, max_num_sequences=4)
    with pytest.raises(ValueError, match="--dtype must be one of auto, bfloat16, float16, float32, got 'fp8'"):
        LLM(model=tiny_model, dtype="fp8")


def test_importing_kvgrid_does_not_import_torch():
    code = (
        "import sys, kvgrid; from kvgrid import SamplingParams; SamplingParams(max_tokens=3); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_offline_engine_imports_no_servicer():
    code = (
        "import re, sys, kvgrid.offline.llm, kvgrid.offline.run_batch; "
        "bad = [m for m in sys.modules if re.fullmatch(r'services\\.(scheduler|worker|tokenizer)\\."
        "(servicer|service|server|main|http_server)', m)]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
