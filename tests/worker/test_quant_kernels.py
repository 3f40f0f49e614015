"""Quantized weights: packed formats equal ggml's own, the native kernels equal a torch reference of
the same arithmetic (AVX-512 VNNI, AVX2 and the scalar fallback, each forced), and GGUF blocks load as
transformers reads them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from services.common.default_model import default_model_path
from services.worker.cpu_kernels.library import QUANT_PATHS, select_quant_path
from services.worker.quant import formats, matmul
from services.worker.quant.gguf_weights import read_gguf, unpermute_rows
from services.worker.quant.matmul import DEQUANTIZE_ROWS, dequantize_rows, linear_into, packed_linear
from services.worker.setup.loader import iter_weights, read_config, resolve_source

GGML_TYPES = {
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "q4_1": gguf.GGMLQuantizationType.Q4_1,
    "q5_0": gguf.GGMLQuantizationType.Q5_0,
}
# The kernel and the reference take the same integer dot products; only float summation order differs.
TOLERANCE = {"atol": 5e-5, "rtol": 1e-5}


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def pack(fmt: str, weight: torch.Tensor) -> formats.PackedWeight:
    """``weight`` in ``fmt``, packed by ggml's own quantizer (the gguf package) or by kvgrid's int8."""
    if fmt == "int8":
        return formats.quantize_int8(weight)
    raw = gguf.quants.quantize(weight.numpy(), GGML_TYPES[fmt])
    return formats.PackedWeight(fmt, torch.from_numpy(raw.copy()).view(weight.shape[0], -1), weight.shape[1])


@pytest.fixture(autouse=True)
def native_int8(monkeypatch):
    """int8 products here take the native kernel (the int8 GEMM has its own tests, test_int8_gemm.py)."""
    monkeypatch.setattr(matmul, "INT8_GEMM_ROWS", None)


@pytest.fixture(params=QUANT_PATHS)
def lib(request):
    """The library forced onto each of its dot products in turn (VNNI, AVX2, the portable scalar one)."""
    if select_quant_path(request.param) != request.param:
        pytest.skip(f"this CPU cannot run the {request.param} path")
    yield request.param
    select_quant_path(QUANT_PATHS[-1])


@pytest.mark.parametrize("fmt", sorted(GGML_TYPES))
def test_dequantize_equals_ggml(fmt):
    weight = randn(37, 96, seed=1)
    packed = pack(fmt, weight)
    expected = torch.from_numpy(gguf.quants.dequantize(packed.data.numpy().reshape(37, -1), GGML_TYPES[fmt]).copy())
    assert torch.equal(formats.dequantize(packed), expected)
    assert torch.equal(dequantize_rows(packed), expected)
    index = torch.tensor([36, 0, 5, 5])
    assert torch.equal(dequantize_rows(packed, index), expected[index])
    tiled = formats.tile(packed)  # the native kernel's rows, as models hold them
    assert torch.equal(dequantize_rows(tiled), expected)
    assert torch.equal(dequantize_rows(tiled, index), expected[index])


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_0", "q4_1", "q5_0"])
def test_tiling_moves_bytes_only(fmt):
    """The kernels' tiled layout: whole tiles of rows, each value where the layout puts it, and back."""
    n, k = 13, 45 if fmt == "int8" else 64
    packed = pack(fmt, randn(n, k, seed=13))
    tiled = formats.tile(packed)
    assert tiled.tiled and tiled.shape == (n, k) and tiled.data.shape[0] == 16
    assert torch.equal(formats.untile(tiled).data, packed.data)
    assert torch.equal(formats.dequantize(tiled), formats.dequantize(packed))
    # row 9 is row 1 of the second tile: its first four values sit at bytes 4-7 of that tile's values
    first = tiled.data.view(-1)[tiled.data.numel() // 2 :]  # tile 1, block 0
    header = {"int8": 0, "q4_1": 32}.get(fmt, 16)
    values = first[header + 4 : header + 8]
    if fmt.startswith(("q4", "q5")):
        expected, _, _ = formats.block_values(packed)  # nibbles: value j low, j + 16 high
        offset = {"q4_0": 8, "q5_0": 16}.get(fmt, 0)
        assert (values.int() & 15).tolist() == ((expected[9, 0, :4] + offset) & 15).tolist()
    else:
        row = packed.data[9] if fmt == "int8" else packed.data[9, 2:6]
        assert values.view(torch.int8).tolist() == row[:4].view(torch.int8).tolist()


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_0", "q4_1", "q5_0"])
@pytest.mark.parametrize("rows,n,k", [(1, 64, 64), (3, 37, 96), (9, 130, 160)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_equals_reference(lib, fmt, rows, n, k, dtype):
    x = randn(rows, k, seed=2).to(dtype)
    packed = pack(fmt, randn(n, k, seed=3))
    bias = randn(n, seed=4).to(dtype)
    out = torch.full((rows, n), float("nan"), dtype=dtype)
    linear_into(x, packed, bias, out)
    expected = formats.reference_linear(x.float(), packed, bias.float()).to(dtype)
    tolerance = TOLERANCE if dtype == torch.float32 else {"atol": 1e-2, "rtol": 8e-3}
    torch.testing.assert_close(out, expected, **tolerance)
    # and the arithmetic stays close to the float product it stands for
    exact = x.float() @ formats.dequantize(packed).T + bias.float()
    assert (out.float() - exact).abs().max() < 0.05 * exact.abs().max()


@pytest.mark.parametrize("k", [45, 33, 31])
@pytest.mark.parametrize("rows", [1, 4])
def test_int8_widths_off_the_block(lib, k, rows):
    """int8 rows need not fill whole 32-value blocks: the last block is zero-padded on both sides."""
    x, packed = randn(rows, k, seed=5), pack("int8", randn(7, k, seed=6))
    out = torch.empty(rows, 7)
    linear_into(x, packed, None, out)
    torch.testing.assert_close(out, formats.reference_linear(x, packed), **TOLERANCE)
    out16 = torch.empty(rows, 7, dtype=torch.bfloat16)
    linear_into(x.bfloat16(), packed, None, out16)
    expected = formats.reference_linear(x.bfloat16().float(), packed).bfloat16()
    torch.testing.assert_close(out16, expected, atol=1e-2, rtol=8e-3)


def test_path_selection():
    """Each path can be forced; asking for one this CPU lacks gives the fastest below it."""
    assert select_quant_path("scalar") == "scalar"
    best = select_quant_path(QUANT_PATHS[-1])
    assert QUANT_PATHS.index(select_quant_path("avx2")) <= QUANT_PATHS.index(best)
    assert select_quant_path(best) == best


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_0", "q4_1", "q5_0"])
def test_extreme_values(lib, fmt):
    """Full-range weights and activations (int8 +-127 both sides: VNNI's x + 128 reaches 255), zero
    blocks, and one huge value per row (the rest of its block quantizes to small integers)."""
    k = 96
    weight = torch.where(randn(24, k, seed=14) > 0, 1.0, -1.0) * torch.linspace(0.0, 2.0, k)
    weight[3] = 0.0
    x = torch.where(randn(3, k, seed=15) > 0, 1.0, -1.0)
    x[1, 32:64] = 0.0
    x[2, 5] = 1e4
    packed = pack(fmt, weight)
    out = torch.empty(3, 24)
    linear_into(x, packed, None, out)
    torch.testing.assert_close(out, formats.reference_linear(x, packed), atol=1e-4, rtol=1e-5)


def test_accumulates_into_strided_rows(lib):
    """y += x W^T into every other column: the residual add, rounded as torch rounds it."""
    x, packed = randn(2, 64, seed=7), pack("q4_1", randn(16, 64, seed=8))
    y = randn(2, 32, seed=9)
    expected = y.clone()
    expected[:, :16] += formats.reference_linear(x, packed)
    linear_into(x, packed, None, y, accumulate=True)
    torch.testing.assert_close(y, expected, **TOLERANCE)


def test_many_rows_take_a_dequantized_gemm():
    """From DEQUANTIZE_ROWS rows the product is torch's over the dequantized weight."""
    x, packed = randn(DEQUANTIZE_ROWS, 64, seed=10), pack("q8_0", randn(24, 64, seed=11))
    torch.testing.assert_close(packed_linear(x, packed), x @ formats.dequantize(packed).T, atol=1e-4, rtol=1e-4)


def test_gguf_blocks_read_as_transformers_reads_them():
    """q/k rows un-permuted like transformers' reader: dequantized, every tensor is equal."""
    source = resolve_source(default_model_path())
    hf_config, args = read_config(source)
    expected = dict(iter_weights(source, hf_config))
    ours = dict(read_gguf(source.path, args.num_heads, args.num_kv_heads))
    assert ours.keys() == expected.keys()
    kinds = {v.format for v in ours.values() if isinstance(v, formats.PackedWeight)}
    assert kinds == {"q4_1", "q8_0"}  # the default file: Q4_1 matrices, a Q8_0 embedding
    for name, value in ours.items():
        dense = formats.dequantize(value) if isinstance(value, formats.PackedWeight) else value
        assert torch.equal(dense, expected[name].float()), name


def test_int8_quantization_is_per_channel():
    weight = randn(5, 40, seed=12) * torch.tensor([1.0, 10.0, 0.1, 3.0, 0.0])[:, None]
    packed = formats.quantize_int8(weight)
    assert packed.data.dtype == torch.int8 and packed.data.abs().max() == 127
    torch.testing.assert_close(packed.scales[:4], weight[:4].abs().amax(1) / 127)
    assert not packed.data[4].any()  # an all-zero channel stays zero
    error = (formats.dequantize(packed) - weight).abs()
    assert (error <= packed.scales[:, None] / 2 + 1e-6).all()


def test_unpermute_matches_numpy_reference():
    rows, heads = 24, 3
    w = np.arange(rows)
    dim = rows // heads // 2
    expected = w.reshape(heads, dim, 2).swapaxes(2, 1).reshape(rows)  # transformers' formula
    assert unpermute_rows(rows, heads).tolist() == expected.tolist()
