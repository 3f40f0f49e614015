"""Batches of rows on a packed weight's bfloat16 copy (``matmul.with_amx_copy``), the tile GEMM of
``cpu_kernels/tile_gemm.py`` (AMX tiles, or AVX512-BF16 dot products without AMX): the copy holds the dequantized
weight in that GEMM's layout, so the products equal ``TileGemm``'s on the dequantized bfloat16 weight bit for bit (and
a float64 reference within bfloat16's rounding) for q8_0 and K-quant weights, odd row counts, more rows than a decode
step, bias, accumulation into strided rows; batches below ``AMX_ROWS`` and float32 rows keep the integer kernel;
shapes outside the tile layout, float32 models and CPUs without a tile kernel keep no copy."""

from __future__ import annotations

import gguf
import pytest
import torch

from services.worker.cpu_kernels import tile_gemm
from services.worker.models.llama import PACKED_GEMM_LIMIT
from services.worker.quant import formats, matmul
from services.worker.quant.install import add_amx_copies
from services.worker.quant.matmul import dequantize_rows, linear_into, packed_linear, with_amx_copy
from tests.worker.kquant_pack import quantize


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def pack(fmt: str, weight: torch.Tensor) -> formats.PackedWeight:
    if fmt == "q8_0":
        raw = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
    else:
        raw = quantize(weight.numpy(), fmt)
    return matmul.kernel_layout(
        formats.PackedWeight(fmt, torch.from_numpy(raw.copy()).view(weight.shape[0], -1), weight.shape[1])
    )


def reference(x: torch.Tensor, packed: formats.PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Both operands rounded to bfloat16, the sums in float64."""
    weight = dequantize_rows(packed).to(torch.bfloat16).double()
    out = x.to(torch.bfloat16).double() @ weight.T
    return (out if bias is None else out + bias.double()).float()


def tiles_of(packed: formats.PackedWeight) -> tile_gemm.TileGemm:
    """The AMX tile GEMM on the dequantized weight rounded to bfloat16."""
    return tile_gemm.TileGemm(dequantize_rows(packed).to(torch.bfloat16))


BF16 = {"atol": 3e-2, "rtol": 8e-3}  # one rounding of the output to bfloat16


@pytest.fixture
def amx():
    if matmul.AMX_ROWS is None or not tile_gemm.available():
        pytest.skip("this CPU runs no tile kernel (AMX-BF16 or AVX512-BF16)")


@pytest.mark.parametrize("fmt,k", [("q8_0", 640), ("q8_0", 96), ("q4_k", 512), ("q6_k", 256)])
@pytest.mark.parametrize("rows,n", [(8, 32), (17, 1024), (64, 96), (77, 64), (600, 32)])
def test_equals_the_tile_gemm_on_the_dequantized_weight(amx, fmt, k, rows, n):
    packed = with_amx_copy(pack(fmt, randn(n, k, seed=1)))
    assert packed.amx is not None and packed.amx.shape == (n // 32, k // 32, 16, 32, 2)
    x = randn(rows, k, seed=2).to(torch.bfloat16)
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
    linear_into(x, packed, None, out)
    expected = torch.empty_like(out)
    tiles_of(packed).into(x[:512], expected[:512])
    if rows > 512:  # (TileGemm hands more rows to oneDNN; the copy keeps to the tiles)
        tiles_of(packed).into(x[512:], expected[512:])
    assert torch.equal(out, expected)
    torch.testing.assert_close(out.float(), reference(x, packed), **BF16)
    assert torch.equal(packed_linear(x, packed), out)  # the logits' entry point too


def test_bias_and_accumulate_into_strided_rows(amx):
    packed = with_amx_copy(pack("q8_0", randn(64, 64, seed=3)))
    x, bias = randn(20, 64, seed=4).to(torch.bfloat16), randn(64, seed=5).to(torch.bfloat16)
    y = randn(20, 90, seed=6).to(torch.bfloat16)
    expected = y.clone()
    tiles_of(packed).into(x, expected[:, :64], bias, accumulate=True)
    linear_into(x, packed, bias, y[:, :64], accumulate=True)
    assert torch.equal(y, expected)
    torch.testing.assert_close(y[:, 64:], expected[:, 64:], atol=0, rtol=0)  # the columns past N untouched


@pytest.mark.parametrize("rows,dtype", [(None, torch.bfloat16), (64, torch.float32)])
def test_few_rows_and_float32_rows_keep_the_integer_kernel(amx, rows, dtype):
    plain = pack("q8_0", randn(32, 64, seed=7))
    copied = with_amx_copy(plain)
    x = randn(rows or matmul.AMX_ROWS - 1, 64, seed=8).to(dtype)
    a, b = torch.empty(x.shape[0], 32, dtype=dtype), torch.empty(x.shape[0], 32, dtype=dtype)
    linear_into(x, plain, None, a)
    linear_into(x, copied, None, b)
    assert torch.equal(a, b)  # the same integer products, bit for bit
    tiled = torch.empty_like(b, dtype=torch.bfloat16)
    tiles_of(copied).into(x.to(torch.bfloat16), tiled)
    assert not torch.equal(b.to(torch.bfloat16), tiled)  # (which the tiles' products would tell apart)


def test_shapes_outside_the_tile_layout_keep_no_copy(amx):
    """N = 40 rows (the blocks along K are 32 already): whole groups of 32 only."""
    packed = pack("q8_0", randn(40, 64, seed=9))
    assert with_amx_copy(packed) is packed


def test_no_copy_without_amx(monkeypatch):
    monkeypatch.setattr(matmul, "AMX_ROWS", None)
    packed = pack("q8_0", randn(32, 64, seed=9))
    assert with_amx_copy(packed) is packed


def tiny_packed_model():
    from services.worker.attention.torch_backend import TorchAttentionBackend
    from services.worker.layers.linear import Linear
    from services.worker.models.llama import LlamaArgs, LlamaForCausalLM

    args = LlamaArgs("LlamaForCausalLM", 96, 64, 128, 2, 4, 2, 16, 1e-6, 10000.0, 64, True)
    model = LlamaForCausalLM(args, TorchAttentionBackend())
    modules = [m for m in model.modules() if isinstance(m, Linear)] + [model.embed_tokens]
    for i, module in enumerate(modules):
        module.packed = pack("q8_0", randn(*module.weight.shape, seed=20 + i))
    return model, modules[:-1]


def test_model_copies_every_product_within_the_limit(amx):
    model, linears = tiny_packed_model()
    add_amx_copies(model, model.logits_module, PACKED_GEMM_LIMIT, torch.bfloat16)
    assert model.embed_tokens.packed.amx is not None  # the (tied) LM head
    assert all(m.packed.amx is not None for m in linears)


def test_model_copies_the_lm_head_alone_when_all_are_over_the_limit(amx):
    model, linears = tiny_packed_model()
    lm_head = 2 * 96 * 64
    add_amx_copies(model, model.logits_module, lm_head, torch.bfloat16)
    assert model.embed_tokens.packed.amx is not None
    assert all(m.packed.amx is None for m in linears)
    model, linears = tiny_packed_model()
    add_amx_copies(model, model.logits_module, lm_head - 1, torch.bfloat16)
    assert model.embed_tokens.packed.amx is None and all(m.packed.amx is None for m in linears)


def test_float32_models_keep_no_copy(amx):
    model, linears = tiny_packed_model()
    add_amx_copies(model, model.logits_module, PACKED_GEMM_LIMIT, torch.float32)
    assert model.embed_tokens.packed.amx is None and all(m.packed.amx is None for m in linears)
