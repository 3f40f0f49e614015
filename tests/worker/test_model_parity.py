"""kvgrid's models (each family, sliding windows included) equal transformers on tiny random configurations."""

from __future__ import annotations

import pytest
import torch

from services.worker.setup.build import create_runner, load_model
from tests.worker.tiny import hf_model, request, run_logits, save_tiny_model

CONFIGS = {
    "llama-gqa-untied": ("llama", {}),
    "llama-tied-mha": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "llama-mqa": ("llama", {"num_key_value_heads": 1}),
    "llama3-rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "yarn-rope": (
        "llama",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    ),
    "qwen2-bias-tied": ("qwen2", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {"sliding_window": None}),
    # Every layer slides over 8 positions: the prompts below run past it, chunks start beyond it.
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "qwen3-qk-norm": ("qwen3", {}),
    "qwen3-tied-window": (
        "qwen3",
        {"tie_word_embeddings": True, "sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1},
    ),
    "phi3-fused": ("phi3", {}),
    "gemma3-interleaved": ("gemma3", {}),
    "mixtral-top2-of-4": ("mixtral", {}),
    "qwen3-moe-sparse-step": ("qwen3_moe", {}),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    kind, overrides = CONFIGS[request.param]
    path = save_tiny_model(str(tmp_path_factory.mktemp(request.param)), kind, **overrides)
    loaded = load_model(path, dtype="float32", device="cpu", attention_backend="torch")
    return loaded, hf_model(path)


def test_logits_equal_transformers(pair):
    loaded, hf = pair
    runner = create_runner(loaded, block_size=4, num_blocks=64)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (1, 7, 23, 40)]
    # Scattered, non-contiguous block tables.
    perm = torch.randperm(64, generator=g).tolist()
    requests, offset = [], 0
    for i, p in enumerate(prompts):
        num_blocks = -(-len(p) // 4)
        requests.append(request(f"r{i}", p, perm[offset : offset + num_blocks], 0, len(p)))
        offset += num_blocks
    inputs = runner.prepare(requests)
    hidden = loaded.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
    logits_all = loaded.model.compute_logits(hidden)
    starts = inputs.meta.query_start_loc.tolist()
    for i, r in enumerate(inputs.batch):  # every row, not only the sampling ones
        ours = logits_all[starts[i] : starts[i + 1]]
        with torch.no_grad():
            ref = hf(torch.tensor([r.token_ids])).logits[0]
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_and_decode_equal_transformers(pair):
    loaded, hf = pair
    runner = create_runner(loaded, block_size=4, num_blocks=32)
    tokens = torch.randint(0, 160, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    blocks = [9, 3, 17, 0, 25, 12, 6, 30]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    r = request("a", tokens[:21], blocks, 0, 8)
    assert run_logits(runner, [r]) == {}  # a chunk that does not finish the prompt samples nothing
    r.num_scheduled_tokens = 13
    torch.testing.assert_close(run_logits(runner, [r])["a"], ref[20], atol=1e-4, rtol=1e-4)
    for t in tokens[21:]:  # decode steps, feeding the reference tokens
        r.token_ids.append(t)
        r.num_scheduled_tokens = 1
        got = run_logits(runner, [r])["a"]
        torch.testing.assert_close(got, ref[len(r.token_ids) - 1], atol=1e-4, rtol=1e-4)


def test_mixed_batch_equals_each_request_alone(pair):
    """Prefills, a chunk over a cached prefix and decodes in one step give what each gives alone."""
    loaded, _ = pair
    g = torch.Generator().manual_seed(3)
    tokens = {name: torch.randint(0, 160, (n,), generator=g).tolist() for name, n in [("a", 13), ("b", 20), ("c", 9)]}
    tokens["d"] = torch.randint(0, 160, (6,), generator=g).tolist()
    # (name, tokens known, blocks, already computed, scheduled now): b and d decode, c continues a chunk.
    layout = [("a", 13, [4, 11, 0, 7], 0, 13), ("b", 20, [2, 9, 14, 5, 1], 19, 1), ("c", 9, [6, 3, 12], 4, 5)]
    layout.append(("d", 6, [8, 10], 5, 1))

    def fresh_runner_with_prefixes(names):
        runner = create_runner(loaded, block_size=4, num_blocks=16)
        prefix = [request(n, tokens[n][:k], blk, 0, c) for n, k, blk, c, _ in layout if n in names and c > 0]
        if prefix:
            run_logits(runner, prefix)
        return runner

    def step(runner, names):
        batch = [request(n, tokens[n][:k], blk, c, s) for n, k, blk, c, s in layout if n in names]
        return run_logits(runner, batch)

    together = step(fresh_runner_with_prefixes("abcd"), "abcd")
    assert sorted(together) == ["a", "b", "c", "d"]
    for name in "abcd":
        alone = step(fresh_runner_with_prefixes(name), name)
        torch.testing.assert_close(together[name], alone[name], atol=1e-5, rtol=1e-5)


def test_bfloat16_upcast_matmuls_match_native(tmp_path):
    """bf16 weights multiplied in float32 (CPUs without bf16 units) give the native bf16 GEMM's results."""
    path = save_tiny_model(str(tmp_path / "m"), "llama", tie_word_embeddings=True)
    tokens = torch.randint(0, 160, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([tokens])).logits[0, -1]
    logits = {}
    for upcast in (False, True):
        loaded = load_model(path, dtype="bfloat16", device="cpu", attention_backend="torch", upcast_matmuls=upcast)
        assert loaded.model.layers[0].mlp.down_proj.upcast is upcast
        runner = create_runner(loaded, block_size=4, num_blocks=8)
        logits[upcast] = run_logits(runner, [request("a", tokens, [3, 1, 6], 0, 12)])["a"].float()
    torch.testing.assert_close(logits[True], logits[False], atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(logits[True], ref, atol=6e-2, rtol=6e-2)


def test_upcast_float32_copies_equal_per_call_conversion(tmp_path):
    """The float32 weight copies kept by set_upcast_matmuls give exactly the per-call conversion's logits."""
    path = save_tiny_model(str(tmp_path / "m"), "llama")
    tokens = torch.randint(0, 160, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    logits = {}
    for limit in (0, 2**30):
        loaded = load_model(path, dtype="bfloat16", device="cpu", attention_backend="torch", upcast_matmuls=True)
        loaded.model.set_upcast_matmuls(True, float32_copy_limit=limit)
        kept = loaded.model.layers[0].self_attn.qkv_proj.weight_f32
        assert (kept is not None) == (limit > 0)
        assert (loaded.model.logits_weight_f32 is not None) == (limit > 0)
        runner = create_runner(loaded, block_size=4, num_blocks=8)
        logits[limit] = run_logits(runner, [request("a", tokens, [3, 1, 6], 0, 12)])["a"]
    torch.testing.assert_close(logits[2**30], logits[0], atol=0, rtol=0)
