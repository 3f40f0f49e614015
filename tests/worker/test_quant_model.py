"""Quantized weights in the model: int8 from a float checkpoint on a tiny Llama (through the int8 GEMM
and through the native kernel), decode steps on the native path equal to the torch path over the
same packed weights, and close to the float model."""

from __future__ import annotations

import pytest
import torch

from services.worker.layers.linear import Embedding, Linear
from services.worker.quant import matmul
from services.worker.setup.build import create_runner, load_model
from tests.worker.tiny import request, run_logits, save_tiny_model


@pytest.mark.parametrize("gemm_rows", [1, None, 8], ids=["int8-gemm", "native-kernel", "both"])
@pytest.mark.parametrize("num_requests", [2, 20])
def test_int8_decode_steps(tmp_path, monkeypatch, num_requests, gemm_rows):
    """With both layouts (the GEMM from 8 rows) 2 requests take the native kernel and 20 the GEMM."""
    monkeypatch.setattr(matmul, "INT8_GEMM_ROWS", gemm_rows)
    for ours, torch_path, float_logits in decode_steps(tmp_path, num_requests):
        # Same packed weights and kernels; norms summed in another order can move an activation
        # across a rounding boundary of its int8 block, hence the quantization-sized tolerance.
        torch.testing.assert_close(ours, torch_path, atol=2e-3, rtol=0)
        assert (ours - float_logits).abs().max() < 0.02 * float_logits.abs().max() + 1e-3


def test_int8_batch_one_takes_prepared_calls(tmp_path, monkeypatch):
    """Batch 1 runs the layers in one native call (NativeCpuPath.layers_program) and the logits through the
    kernel with arguments prepared once per weight (NativeCpuPath.packed_gemv): the same logits as the torch path
    over the same packed weights."""
    monkeypatch.setattr(matmul, "INT8_GEMM_ROWS", None)  # the prepared calls read the tiled layout
    calls = {}
    for ours, torch_path, _ in decode_steps(tmp_path, 1, calls):
        torch.testing.assert_close(ours, torch_path, atol=2e-3, rtol=0)
    assert len(calls) == 1  # the logits'; the layers' products are in the one call's description


def decode_steps(tmp_path, num_requests: int, prepared: dict | None = None) -> list[tuple[torch.Tensor, ...]]:
    """Four decode steps of a tiny int8 model: (native logits, torch path's, the float model's) per step.
    ``prepared`` receives the native path's prepared calls."""
    path = save_tiny_model(str(tmp_path), "qwen2", tie_word_embeddings=False)
    quantized = load_model(path, dtype="float32", device="cpu", attention_backend="torch", quantization="int8")
    dense = load_model(path, dtype="float32", device="cpu", attention_backend="torch")
    modules = [m for m in quantized.model.modules() if isinstance(m, Linear | Embedding)]
    assert modules and all(m.packed is not None and m.packed.format == "int8" for m in modules)
    assert all(m.weight.numel() == 0 for m in modules)  # no float copy kept
    assert quantized.weights_bytes < dense.weights_bytes / 3
    native = quantized.model.native_path
    assert native is not None
    num_blocks = 6 * num_requests
    runners = [create_runner(m, block_size=4, num_blocks=num_blocks) for m in (quantized, dense)]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 160, (3 + i % 7,), generator=g).tolist() for i in range(num_requests)]
    per_runner = [
        [request(f"r{i}", p, list(range(i, num_blocks, num_requests)), 0, len(p)) for i, p in enumerate(prompts)]
        for _ in runners
    ]
    for runner, requests in zip(runners, per_runner, strict=True):
        run_logits(runner, requests)  # prefill: packed weights through the torch path
    steps = []
    for _step in range(4):
        token = torch.randint(0, 160, (num_requests,), generator=g).tolist()
        logits = []
        for runner, requests in zip(runners, per_runner, strict=True):
            for r, t in zip(requests, token, strict=True):
                r.token_ids.append(t)
                r.num_scheduled_tokens = 1
            inputs = runner.prepare(requests)
            with torch.inference_mode():
                if runner is runners[0]:
                    quantized.model.set_native_path(None)
                    torch_path = runner.compute_logits(inputs)
                    quantized.model.set_native_path(native)
                logits.append(runner.compute_logits(inputs))
            for r in requests:
                r.num_computed_tokens += 1
                r.num_scheduled_tokens = 0
        steps.append((logits[0], torch_path, logits[1]))
    if prepared is not None:
        prepared.update(native._packed_calls)
        assert native._program is not None
    return steps
