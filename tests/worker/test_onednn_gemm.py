"""bfloat16 products on weights reordered once for oneDNN are torch's own, and the model reorders what it should."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.cpu_kernels import library, onednn_gemm, tile_gemm
from services.worker.setup.build import create_runner, load_model
from tests.worker.test_cpu_kernels import TOLERANCE, forced_linear_path
from tests.worker.tiny import drop_packed_gemms, request, run_logits, save_tiny_model

pytestmark = pytest.mark.skipif(not onednn_gemm.available(), reason="this torch build has no oneDNN bfloat16 GEMM")


def bf16(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(torch.bfloat16)


@pytest.mark.parametrize("n,k", [(960, 576), (37, 45), (200, 136)])
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 513])
@pytest.mark.parametrize("bias", [False, True])
def test_reordered_gemm_equals_linear(n, k, rows, bias):
    """The same kernels as F.linear's on a layout chosen once: the same bits."""
    g = torch.Generator().manual_seed(rows)
    w, x = bf16(n, k, generator=g), bf16(rows, k, generator=g)
    b = bf16(n, generator=g) if bias else None
    got = onednn_gemm.OnednnGemm(w)(x, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert torch.equal(got, F.linear(x, w, b))


def test_reordered_gemm_takes_bfloat16_matrices_only():
    with pytest.raises(ValueError, match="bfloat16"):
        onednn_gemm.OnednnGemm(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="2-D"):
        onednn_gemm.OnednnGemm(torch.zeros(4, dtype=torch.bfloat16))


def step_logits(loaded) -> torch.Tensor:
    """Three prompts in one step (18 rows), a decode step of the three, then one of the first alone: the logits."""
    runner = create_runner(loaded, block_size=4, num_blocks=24)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (5, 11, 2)]
    requests = [request(f"r{i}", p, list(range(8 * i, 8 * i + 8)), 0, len(p)) for i, p in enumerate(prompts)]
    logits = [*run_logits(runner, requests).values()]
    for step in (requests, requests[:1]):
        for r in step:
            r.num_computed_tokens = len(r.token_ids)
            r.token_ids.append(7)
            r.num_scheduled_tokens = 1
        logits += run_logits(runner, step).values()
    return torch.stack(logits)


@pytest.fixture
def linear_path(request):
    """The native bfloat16 GEMV forced to the path named (one this CPU lacks is skipped; None: this CPU's widest),
    the widest restored after."""
    if request.param is None:
        yield library.linear_path()
        return
    with forced_linear_path(request.param) as name:
        yield name


@pytest.mark.parametrize(
    "cpu_kernels,linear_path", [("torch", None), ("native", "avx2"), ("native", "avx512-bf16")],
    indirect=["linear_path"],
)  # fmt: skip
def test_model_reorders_bfloat16_weights_where_the_cpu_has_units(tmp_path, cpu_kernels, linear_path, monkeypatch):
    """With bfloat16 units every unquantized matrix and the (tied) logits weight get a reordered copy, which
    takes every product (18, 3 and 1 rows) on the torch path, and on the native path too where its GEMV widens
    bfloat16 to float32; where that GEMV multiplies bfloat16 pairs it takes the products of up to 4 rows. The
    logits are the unreordered model's (torch's: the same bits). Without bfloat16 units nothing is reordered."""
    monkeypatch.setattr(tile_gemm, "available", lambda: False)  # the layers' AMX tiles: test_tile_gemm.py
    path = save_tiny_model(str(tmp_path), "qwen2", tie_word_embeddings=True)  # biases on q, k, v
    # Not upcast, whatever this CPU has: set_packed_gemms is told below whether there are bfloat16 units.
    loaded = load_model(
        path, dtype="bfloat16", device="cpu", attention_backend="torch", cpu_kernels=cpu_kernels, upcast_matmuls=False
    )
    model = loaded.model
    assert (model.native_path is not None) == (cpu_kernels == "native")
    linears = [m for m in model.modules() if m.__class__.__name__ == "Linear"]
    drop_packed_gemms(model)
    assert "no float32 weights" in model.set_packed_gemms(bf16_units=False) and model.packed_gemm_bytes() == 0
    plain = step_logits(loaded)

    assert "every product on oneDNN's reordered bfloat16 weights" in model.set_packed_gemms(bf16_units=True)
    assert all(isinstance(m.gemm, onednn_gemm.OnednnGemm) for m in linears)
    assert isinstance(model.logits_gemm, onednn_gemm.OnednnGemm) and model.logits_weight_f32 is None
    weights = sum(m.weight.numel() for m in linears) + model.embed_tokens.weight.numel()
    assert model.packed_gemm_bytes() == 2 * weights
    pairs = model.native_path is not None and linear_path == "avx512-bf16"
    if pairs:
        assert model.native_path.matmul_path() == (
            "the native GEMV on bfloat16 pairs up to 4 rows, the GEMM on oneDNN's reordered bfloat16 weights above"
        )
    elif model.native_path is not None:
        assert model.native_path.matmul_path() == "the GEMM on oneDNN's reordered bfloat16 weights at every row count"
    rows = []
    product = onednn_gemm.OnednnGemm.__call__
    monkeypatch.setattr(
        onednn_gemm.OnednnGemm, "__call__", lambda self, x, b=None: rows.append(x.shape[0]) or product(self, x, b)
    )
    reordered = step_logits(loaded)
    per_step = len(linears) + 1  # and the logits
    few_rows = [] if pairs else [3] + [3] * per_step + [1] * per_step  # the prefill's logits, then the decodes
    assert sorted(rows) == sorted([18] * len(linears) + few_rows)
    if model.native_path is None:
        assert torch.equal(reordered, plain)
    else:  # the native GEMV took 1-3 rows without the reordered weights
        torch.testing.assert_close(reordered.float(), plain.float(), **TOLERANCE[torch.bfloat16])
