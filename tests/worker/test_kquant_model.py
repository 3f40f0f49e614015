"""K-quant matrices in a real model under ``--quantization gguf``: the default SmolLM2 GGUF with its down
projections re-quantized to Q4_K, Q5_K and Q6_K (the only matrices of this 576-wide model whose K, 1536,
is whole 256-value super-blocks) is served with those blocks kept packed, and under teacher forcing its
next-token choice stays within the float32 model's top 5 at every step (the same file dequantized), with
the top 1 agreeing at least 90% of the time."""

from __future__ import annotations

import pytest
import torch

from services.common.default_model import default_model_path
from services.worker.layers.linear import Linear
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
    """blk.<i>.ffn_down.weight -> one of FORMATS by layer; every other tensor as stored."""
    parts = name.split(".")
    return FORMATS[int(parts[1]) % len(FORMATS)] if parts[0] == "blk" and parts[2] == "ffn_down" else None


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("kquant") / "smollm2-kquants.gguf")
    chosen = write_kquant_copy(default_model_path(), path, down_projections_to_kquants)
    assert set(chosen.values()) == set(FORMATS)
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


@pytest.mark.slow
def test_teacher_forcing_stays_in_float_top5(kquant_gguf):
    quantized = load_model(kquant_gguf, dtype="float32", device="cpu", quantization="gguf")
    dense = load_model(kquant_gguf, dtype="float32", device="cpu")
    linears = [m for m in quantized.model.modules() if isinstance(m, Linear) and m.packed is not None]
    down = {m.packed.format for m in linears if m.packed.shape[1] == quantized.args.intermediate_size}
    assert down == set(FORMATS)  # the K-quant blocks are kept packed, not dequantized at load

    tokenizer = load_tokenizer(dense.source)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    expected = step_logits(dense, prompts)
    forced = [logits[:-1].argmax(dim=-1).tolist() for logits in expected]  # the float model's greedy tokens
    ours = step_logits(quantized, prompts, forced)

    agree = total = 0
    for tokens, want, got in zip(forced, expected, ours, strict=True):
        top5 = want.topk(5, dim=-1).indices
        choice = got.argmax(dim=-1)
        assert all(choice[i] in top5[i] for i in range(len(choice))), (tokens, choice.tolist())
        agree += int((choice == want.argmax(dim=-1)).sum())
        total += len(choice)
    assert agree >= 0.9 * total, f"top-1 agreement {agree}/{total}"
