"""bfloat16 products on the tile GEMM (``cpu_kernels.tile_gemm``), each kernel this CPU runs: AMX tiles
(``amx_gemm.h``), oneDNN's sums on 16 rows bit for bit; AVX512-BF16 dot products (``tile_gemm_bf16dot.h``), a
float32 loop over K adding each pair's odd then even product bit for bit. Any number of rows (a row's product does
not depend on the others), bias and accumulation as torch's, oneDNN's GEMM above ``MAX_ROWS``; the model's layers
take them, the LM head keeps oneDNN's where its shape does not fit."""

from __future__ import annotations

import pytest
import torch

from services.worker.cpu_kernels import library, onednn_gemm, tile_gemm
from services.worker.setup.build import load_model
from tests.worker.test_cpu_kernels import TOLERANCE
from tests.worker.test_onednn_gemm import step_logits
from tests.worker.tiny import drop_packed_gemms, save_tiny_model

pytestmark = pytest.mark.skipif(
    not (tile_gemm.available() and onednn_gemm.available()),
    reason="no tile kernel here (AMX-BF16 or AVX512-BF16), or no oneDNN GEMM",
)


@pytest.fixture(params=["amx", "avx512-bf16"])
def kernel(request):
    """Each tile kernel, selected for the test where this CPU runs it (an AMX CPU runs both); the best after."""
    try:
        if library.select_tile_path(request.param) != request.param:
            pytest.skip(f"this CPU does not run the {request.param} tile kernel")
        yield request.param
    finally:
        library.select_tile_path("amx")


def bf16(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(torch.bfloat16)


def by_sixteen(gemm: onednn_gemm.OnednnGemm, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's products 16 rows at a time (the last block padded with zero rows): its sums over the whole of K."""
    rows = x.shape[0]
    padded = torch.zeros(-(-rows // 16) * 16, x.shape[1], dtype=x.dtype)
    padded[:rows] = x
    return torch.cat([gemm(block, bias) for block in padded.split(16)])[:rows]


def pair_sums(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """VDPBF16PS's sums in float32: over K in order, each pair's odd product added, then its even one (products of
    two bfloat16 values are exact in float32), the bias added, rounded to bfloat16."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for p in range(0, x.shape[1], 2):
        acc = acc + xf[:, p + 1, None] * wf[None, :, p + 1]
        acc = acc + xf[:, p, None] * wf[None, :, p]
    return (acc if bias is None else acc + bias.float()).to(torch.bfloat16)


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (64, 96)])
@pytest.mark.parametrize("rows", [1, 5, 16, 20, 64, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_products_are_the_kernels_sums(kernel, n, k, rows, bias):
    """AMX: oneDNN's sums on 16 rows; AVX512-BF16: the float32 loop of its pairs (rows in blocks of 6, the columns
    in pairs of 32-column groups with a single one at a thread's end)."""
    g = torch.Generator().manual_seed(rows + n)
    w, x = bf16(n, k, generator=g), bf16(rows, k, generator=g)
    b = bf16(n, generator=g) if bias else None
    gemm = tile_gemm.TileGemm(w)
    got = gemm(x, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert torch.equal(got, by_sixteen(gemm.large, x, b) if kernel == "amx" else pair_sums(x, w, b))
    assert torch.equal(gemm(x[:3], b), got[:3])  # the same rows alone: the same bits


def test_into_strided_rows_and_accumulating(kernel):
    """Rows of x and out strided (a step's views), and out += product rounded as torch's out.add_(product)."""
    g = torch.Generator().manual_seed(1)
    w, b = bf16(96, 64, generator=g), bf16(96, generator=g)
    x = bf16(24, 128, generator=g)[:, :64]  # rows of stride 128
    gemm = tile_gemm.TileGemm(w)
    product = gemm(x.contiguous(), b)
    base = bf16(24, 200, generator=g)
    out = base.clone()
    gemm.into(x, out[:, 10:106], b)
    assert torch.equal(out[:, 10:106], product) and torch.equal(out[:, :10], base[:, :10])
    out = base.clone()
    gemm.into(x, out[:, 10:106], b, accumulate=True)
    assert torch.equal(out[:, 10:106], base[:, 10:106].clone().add_(product))


def test_more_rows_than_max_take_onednn(monkeypatch):
    g = torch.Generator().manual_seed(2)
    w, x = bf16(64, 64, generator=g), bf16(tile_gemm.MAX_ROWS + 1, 64, generator=g)
    gemm = tile_gemm.TileGemm(w)
    calls = []
    product = onednn_gemm.OnednnGemm.__call__
    monkeypatch.setattr(
        onednn_gemm.OnednnGemm, "__call__", lambda self, x, b=None: calls.append(x.shape[0]) or product(self, x, b)
    )
    assert torch.equal(gemm(x), product(gemm.large, x))
    gemm(x[: tile_gemm.MAX_ROWS])
    assert calls == [tile_gemm.MAX_ROWS + 1]
    with pytest.raises(ValueError, match="up to 512 rows"):  # into: the caller takes oneDNN's own output
        gemm.into(x, torch.empty(x.shape[0], 64, dtype=torch.bfloat16))


def test_shapes_outside_the_layout_are_refused():
    with pytest.raises(ValueError, match="whole 32 x 32 blocks"):
        tile_gemm.TileGemm(torch.zeros(48, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="whole 32 x 32 blocks"):
        tile_gemm.TileGemm(torch.zeros(64, 64))


@pytest.mark.parametrize("cpu_kernels", ["torch", "native"])
def test_model_layers_take_tiles_and_the_lm_head_onednn(tmp_path, cpu_kernels, monkeypatch, kernel):
    """Every product of 1 to 512 rows is on the tiles (18-row prefill; 3- and 1-row decodes where the native GEMV does
    not take them: it takes one row where it multiplies bfloat16 pairs and the tiles are AMX's), none on oneDNN's
    GEMM; a weight whose shape the tiles do not take keeps oneDNN's; the logits stay close to the unpacked model's."""
    path = save_tiny_model(str(tmp_path), "qwen2", tie_word_embeddings=True)  # biases on q, k, v
    loaded = load_model(
        path, dtype="bfloat16", device="cpu", attention_backend="torch", cpu_kernels=cpu_kernels, upcast_matmuls=False
    )
    model = loaded.model
    linears = [m for m in model.modules() if m.__class__.__name__ == "Linear"]
    drop_packed_gemms(model)
    plain = step_logits(loaded)
    said = model.set_packed_gemms(bf16_units=True)
    assert said.startswith(f"every product on {tile_gemm.describe()} weights (+"), said
    assert tile_gemm.describe().startswith("AMX-tiled" if kernel == "amx" else "tiled (AVX512-BF16)")
    assert all(isinstance(m.gemm, tile_gemm.TileGemm) for m in linears)
    assert isinstance(model.logits_gemm, tile_gemm.TileGemm)  # the tied embedding's: 160 x 64
    weights = sum(m.weight.numel() for m in linears) + model.embed_tokens.weight.numel()
    assert model.packed_gemm_bytes() == 2 * 2 * weights  # tiles and oneDNN's copy
    native = model.native_path
    if native is not None:  # the GEMV on bfloat16 pairs leads AMX's tiles at one row (gemv_rows.BF16_TILE_PAIR_ROWS)
        pairs = library.linear_path() == "avx512-bf16" and kernel == "amx"
        assert native.rows.takes_gemv(model.logits_gemm, 1) == pairs
        assert not native.rows.takes_gemv(model.logits_gemm, 2) and native.in_one_call(2)
    rows = []
    product = onednn_gemm.OnednnGemm.__call__
    monkeypatch.setattr(
        onednn_gemm.OnednnGemm, "__call__", lambda self, x, b=None: rows.append(x.shape[0]) or product(self, x, b)
    )
    tiled = step_logits(loaded)
    assert rows == []
    torch.testing.assert_close(tiled.float(), plain.float(), **TOLERANCE[torch.bfloat16])

    drop_packed_gemms(model)  # both copies over the limit: oneDNN's alone, as without tiles
    said = model.set_packed_gemms(limit=2 * 2 * weights - 1, bf16_units=True)
    assert said.startswith("every product on oneDNN's reordered bfloat16 weights (+"), said
    assert not any(isinstance(m.gemm, tile_gemm.TileGemm) for m in linears)

    path = save_tiny_model(str(tmp_path / "odd"), "llama", vocab_size=150)  # an LM head of 150 rows
    model = load_model(path, dtype="bfloat16", device="cpu", cpu_kernels=cpu_kernels, upcast_matmuls=False).model
    said = model.set_packed_gemms(bf16_units=True)
    assert "weights (8 of 9), oneDNN's reordered bfloat16 weights (+" in said, said
    assert isinstance(model.logits_gemm, onednn_gemm.OnednnGemm)


def test_native_path_uses_onednns_own_output_above_max_rows(tmp_path):
    """Up to MAX_ROWS rows the tiles write into the step's buffer; above, the path hands on the tensor oneDNN wrote
    (a copy of a prefill chunk's products into the buffer cost as much as a small product)."""
    loaded = load_model(save_tiny_model(str(tmp_path), "llama"), dtype="bfloat16", device="cpu")
    native, module = loaded.model.native_path, loaded.model.layers[0].mlp.gate_up_proj
    n, k = module.weight.shape
    g = torch.Generator().manual_seed(4)
    x, out = bf16(tile_gemm.MAX_ROWS + 1, k, generator=g), torch.empty(tile_gemm.MAX_ROWS + 1, n, dtype=torch.bfloat16)
    got = native.linear(module, x, out)
    assert got.data_ptr() != out.data_ptr() and torch.equal(got, module.gemm.large(x))
    small = native.linear(module, x[:8], out[:8])
    assert small.data_ptr() == out.data_ptr() and torch.equal(small, module.gemm(x[:8]))
