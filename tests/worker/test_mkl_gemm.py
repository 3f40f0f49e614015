"""float32 products on weights packed once for MKL equal torch's, and the model packs what it should."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.cpu_kernels import mkl_gemm
from services.worker.setup.build import create_runner, load_model
from tests.worker.tiny import drop_packed_gemms, request, run_logits, save_tiny_model

pytestmark = pytest.mark.skipif(not mkl_gemm.available(), reason="this torch build has no MKL")


def assert_same_product(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """Equal to F.linear up to float32 rounding: two libraries sum a length-k dot product in
    different orders (MKL's order differs between Intel and AMD CPUs), so each element may differ
    by about sqrt(k) roundings of the sum of |x_i * w_i|; a wrong row, column or bias is off by
    orders of magnitude more."""
    expected = F.linear(x, w, b)
    scale = x.abs() @ w.abs().T + (0 if b is None else b.abs())
    bound = 4 * x.shape[-1] ** 0.5 * torch.finfo(torch.float32).eps * scale + 1e-6
    err = (got - expected).abs()
    assert bool((err <= bound).all()), f"max error {err.max():.3g}, worst error/bound {(err / bound).max():.3g}"


@pytest.mark.parametrize("n,k", [(960, 576), (37, 45), (200, 136)])
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 513])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_gemm_equals_linear(n, k, rows, bias):
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    bias_before = None if b is None else b.clone()
    assert_same_product(mkl_gemm.PackedGemm(w)(x, b), x, w, b)
    assert b is None or torch.equal(b, bias_before)  # the bias seeds the output, not the other way round


@pytest.mark.parametrize("bias", [False, True])
def test_packed_gemm_writes_into_strided_rows(bias):
    """into: the product (plus bias) lands in the given rows and leaves the columns around them alone;
    an output of the wrong shape or dtype is refused."""
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(24, 40, generator=g), torch.randn(7, 40, generator=g)
    b = torch.randn(24, generator=g) if bias else None
    gemm = mkl_gemm.PackedGemm(w)
    wide = torch.full((7, 30), 3.0)
    gemm.into(x, wide[:, 2:26], b)
    assert_same_product(wide[:, 2:26], x, w, b)
    assert torch.equal(wide[:, :2], torch.full((7, 2), 3.0)) and torch.equal(wide[:, 26:], torch.full((7, 4), 3.0))
    with pytest.raises(ValueError, match="float32"):
        gemm.into(x, torch.empty(7, 24, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[7, 24\]"):
        gemm.into(x, torch.empty(6, 24))


def test_packed_gemm_takes_float32_matrices_only():
    with pytest.raises(ValueError, match="float32"):
        mkl_gemm.PackedGemm(torch.zeros(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D"):
        mkl_gemm.PackedGemm(torch.zeros(4))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_packs_float32_weights_and_keeps_its_tokens(tmp_path, dtype):
    """Every unquantized matrix and the (tied) logits weight get a packed copy; float32 steps of
    several rows give the logits of the unpacked model, and greedy tokens are the same."""
    path = save_tiny_model(str(tmp_path), "qwen2", tie_word_embeddings=True)  # biases on q, k, v
    loaded = load_model(path, dtype=dtype, device="cpu", attention_backend="torch", upcast_matmuls=True)
    model = loaded.model
    linears = [m for m in model.modules() if m.__class__.__name__ == "Linear"]
    assert all(m.gemm is not None and m.weight_f32 is None for m in linears)
    assert model.logits_gemm is not None and model.logits_weight_f32 is None
    weights = sum(m.weight.numel() for m in linears) + model.embed_tokens.weight.numel()
    assert model.packed_gemm_bytes() == 4 * weights

    def step_logits() -> torch.Tensor:
        runner = create_runner(loaded, block_size=4, num_blocks=16)
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (5, 11, 2)]
        requests = [
            request(f"r{i}", p, [4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3], 0, len(p)) for i, p in enumerate(prompts)
        ]
        return torch.stack(list(run_logits(runner, requests).values()))

    packed = step_logits()
    drop_packed_gemms(model)
    model.set_upcast_matmuls(dtype == "bfloat16")
    plain = step_logits()
    tolerance = {"atol": 2e-5, "rtol": 2e-5} if dtype == "float32" else {"atol": 1e-2, "rtol": 8e-3}
    torch.testing.assert_close(packed.float(), plain.float(), **tolerance)
    if dtype == "float32":
        assert torch.equal(packed.argmax(-1), plain.argmax(-1))


def test_model_over_the_limit_keeps_torch_products(tmp_path):
    path = save_tiny_model(str(tmp_path), "llama")
    loaded = load_model(path, dtype="float32", device="cpu", attention_backend="torch")
    model = loaded.model
    drop_packed_gemms(model)
    assert "over the" in model.set_packed_gemms(limit=1024)
    assert model.packed_gemm_bytes() == 0 and model.logits_gemm is None
