"""int8 weights through oneDNN's int8 GEMM (``torch._int_mm``): rows of x quantized to int8 with one
scale each, exact integer sums, both scales after. The native ends of it (row quantization, the
scaled int32 epilogue) equal the torch reference of the same arithmetic, on any CPU."""

from __future__ import annotations

import pytest
import torch

from services.worker.quant import formats, matmul
from services.worker.quant.install import install_int8
from services.worker.quant.matmul import int8_gemm_into, packed_embedding, packed_linear
from services.worker.setup.cpu_features import CpuFeatures


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=["native", "torch"])
def ends(request, monkeypatch):
    """The native library's quantize and epilogue, then torch's (as without a C compiler)."""
    monkeypatch.setattr(matmul, "INT8_GEMM_ROWS", 1)
    if request.param == "torch":
        monkeypatch.setattr(matmul, "_native", lambda: None)
    return request.param


@pytest.mark.parametrize("rows,n,k", [(1, 64, 64), (3, 37, 45), (64, 130, 160), (5, 9, 1537)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("terms", [1, 2])
def test_equals_reference(ends, rows, n, k, dtype, terms):
    """float16 (which the C ends do not take) goes through torch's ends."""
    x = randn(rows, k, seed=1).to(dtype)
    packed = formats.quantize_int8(randn(n, k, seed=2))
    packed.activation_terms = terms
    bias = randn(n, seed=3).to(dtype)
    out = torch.full((rows, n), float("nan"), dtype=dtype)
    int8_gemm_into(x, packed, bias, out)
    expected = formats.reference_int8_gemm(x.float(), packed, bias.float())
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 8e-3}
    torch.testing.assert_close(out, expected.to(dtype), **tolerance)
    # and it stays close to the float product it stands for
    exact = x.float() @ formats.dequantize(packed).T + bias.float()
    assert (out.float() - exact).abs().max() < 0.05 * exact.abs().max()


def test_second_term_takes_back_the_activation_rounding(ends):
    """With one outlier channel per row, one scale per row leaves the rest a few levels; the second
    term (the rounding error, quantized) brings the product within float32 rounding of exact."""
    x = randn(16, 1536, seed=12)
    x[:, 7] = 60.0
    packed = formats.quantize_int8(randn(64, 1536, seed=13))
    exact = x @ formats.dequantize(packed).T
    errors = []
    for terms in (1, 2):
        packed.activation_terms = terms
        out = packed_linear(x, packed)
        errors.append((out - exact).abs().max().item())
    assert errors[1] < errors[0] / 50, errors


def test_accumulates_into_strided_rows(ends):
    """y += x W^T into the first columns of wider rows: the residual add, rounded as torch rounds it."""
    x, packed = randn(2, 64, seed=4), formats.quantize_int8(randn(16, 64, seed=5))
    y = randn(2, 40, seed=6)
    expected = y.clone()
    expected[:, :16] += formats.reference_int8_gemm(x, packed)
    int8_gemm_into(x, packed, None, y, accumulate=True)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_zero_rows_give_zeros(ends):
    x = randn(3, 96, seed=7)
    x[1] = 0
    out = packed_linear(x, formats.quantize_int8(randn(8, 96, seed=8)))
    assert torch.equal(out[1], torch.zeros(8)) and out[0].abs().sum() > 0


def test_many_rows_stay_on_the_int8_gemm(ends):
    """Prefill chunks too: from DEQUANTIZE_ROWS rows int8 weights are not dequantized."""
    x, packed = randn(matmul.DEQUANTIZE_ROWS + 5, 64, seed=9), formats.quantize_int8(randn(24, 64, seed=10))
    torch.testing.assert_close(packed_linear(x, packed), formats.reference_int8_gemm(x, packed), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gemm_rows", [1, None, 8], ids=["gemm", "native", "both"])
def test_models_keep_the_layout_their_products_read(monkeypatch, gemm_rows):
    """With the int8 GEMM for every product a model keeps its rows as stored; with the native kernel,
    tiled; with the GEMM from 8 rows, both, and each row count takes its own. Embedding lookups read
    every layout."""
    monkeypatch.setattr(matmul, "INT8_GEMM_ROWS", gemm_rows)
    table = torch.nn.Embedding(50, 40)
    table.weight.data = randn(50, 40, seed=11)
    expected = formats.dequantize(formats.quantize_int8(table.weight))
    install_int8(table, [table])
    packed = table.packed
    assert packed.tiled is (gemm_rows != 1) and (packed.stored is not None) is (gemm_rows == 8)
    assert table.weight.numel() == 0 and packed.nbytes >= (2 if gemm_rows == 8 else 1) * 50 * 40
    ids = torch.tensor([49, 0, 7, 7])
    torch.testing.assert_close(packed_embedding(packed, ids, torch.float32), expected[ids])

    calls = []
    int_mm = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(a.shape[0]) or int_mm(a, b))
    for rows in (1, 3, 8, 20):
        x = randn(rows, 40, seed=rows)
        exact = x @ expected.T
        assert (packed_linear(x, packed) - exact).abs().max() < 0.02 * exact.abs().max()
    takes_gemm = [rows for rows in (1, 3, 8, 20) if gemm_rows is not None and rows >= gemm_rows]
    assert calls == takes_gemm


@pytest.mark.parametrize(
    "flags,rows,logged",
    [
        ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_int8"}, 1, "AMX-INT8 units"),
        ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, 24, "below 24 rows"),
        ({"avx2", "fma", "avx_vnni"}, None, "AVX2 integer dot products"),
        (set(), None, "scalar"),
    ],
    ids=["amx", "avx512-vnni", "avx2", "none"],
)
def test_cpu_decides_where_the_int8_gemm_starts(flags, rows, logged):
    """The GEMM from one row with AMX, from 24 with AVX-512 VNNI (both layouts), never on AVX2; the log says which."""
    cpu = CpuFeatures(frozenset(flags), "DEFAULT")
    assert cpu.int8_gemm_rows == rows
    assert logged in cpu.fast_path("float32", "int8")
