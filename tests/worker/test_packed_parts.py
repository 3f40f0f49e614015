"""A fused matrix whose GGUF parts differ in type (q and k in one, v in another) stays packed as parts:
``install_gguf`` keeps each run of one format, and the layer's products, on every native path, into
strided columns and at the row counts that dequantize, equal each part's reference side by side."""

from __future__ import annotations

import gguf
import pytest
import torch
from torch import nn

from services.worker.cpu_kernels.library import QUANT_PATHS, select_quant_path
from services.worker.layers.linear import Linear
from services.worker.quant import formats
from services.worker.quant.install import install_gguf
from services.worker.quant.matmul import DEQUANTIZE_ROWS, linear_into
from tests.worker.kquant_pack import quantize

K = 512
ROWS = {"q": 32, "k": 16, "v": 16}


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def pack(fmt: str, weight: torch.Tensor) -> formats.PackedWeight:
    if fmt in ("q4_k", "q5_k", "q6_k"):
        raw = quantize(weight.numpy(), fmt)
    else:
        raw = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType[fmt.upper()])
    return formats.PackedWeight(fmt, torch.from_numpy(raw.copy()).view(weight.shape[0], -1), weight.shape[1])


@pytest.fixture(params=QUANT_PATHS)
def lib(request):
    if select_quant_path(request.param) != request.param:
        pytest.skip(f"this CPU cannot run the {request.param} path")
    yield request.param
    select_quant_path(QUANT_PATHS[-1])


@pytest.fixture
def fused():
    """A qkv Linear with q and k as q4_k and v as q6_k (as Q4_K_M files store some layers), and its pieces."""
    model = nn.Module()
    model.qkv = Linear(K, sum(ROWS.values()), bias=True)
    with torch.no_grad():
        model.qkv.bias.copy_(randn(sum(ROWS.values()), seed=1))
    kinds = {"q": "q4_k", "k": "q4_k", "v": "q6_k"}
    pieces, offset = [], 0
    for i, (part, rows) in enumerate(ROWS.items()):
        pieces.append((offset, pack(kinds[part], randn(rows, K, seed=10 + i) * 0.1)))
        offset += rows
    install_gguf(model, {"qkv.weight": list(reversed(pieces))})  # (in any order)
    return model.qkv, [p for _, p in pieces]


def reference(x: torch.Tensor, pieces: list[formats.PackedWeight], bias: torch.Tensor) -> torch.Tensor:
    return torch.cat([formats.reference_linear(x, p) for p in pieces], dim=1) + bias


def test_install_keeps_runs_of_one_format(fused):
    layer, pieces = fused
    assert isinstance(layer.packed, formats.PackedParts)
    assert layer.packed.formats == ["q4_k", "q6_k"]  # q and k joined, v apart
    assert layer.packed.shape == (sum(ROWS.values()), K)
    assert layer.weight.numel() == 0  # no float copy kept
    assert layer.packed.nbytes == sum(p.nbytes for p in pieces)


@pytest.mark.parametrize("rows", [1, 5])
def test_forward_and_strided_accumulate(lib, fused, rows):
    layer, pieces = fused
    x = randn(rows, K, seed=2)
    expected = reference(x, pieces, layer.bias.detach())
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-5)
    y = randn(rows, 2 * expected.shape[1], seed=3)  # into the first half of wider rows, added
    want = y.clone()
    want[:, : expected.shape[1]] += expected
    linear_into(x, layer.packed, layer.bias.detach(), y, accumulate=True)
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-5)


def test_many_rows_dequantize_the_parts(fused):
    layer, pieces = fused
    x = randn(DEQUANTIZE_ROWS + 3, K, seed=4)
    dense = torch.cat([formats.dequantize(p) for p in pieces])
    torch.testing.assert_close(layer(x), x @ dense.T + layer.bias.detach(), atol=1e-4, rtol=1e-4)
