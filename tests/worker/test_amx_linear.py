"""The AMX-BF16 product of a packed weight's bfloat16 copy (``matmul.with_amx_copy``, ``cpu_kernels/amx_bf16.h``):
equal to a torch reference of the same arithmetic (x and the dequantized weight rounded to bfloat16, float32
sums) for q8_0 and K-quant weights, odd row counts and more than 64 rows, bias, accumulation into strided
rows; batches below ``AMX_ROWS`` keep the integer kernel, and CPUs without AMX-BF16 keep no copy."""

from __future__ import annotations

import gguf
import pytest
import torch

from services.worker.cpu_kernels.library import load_quant
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
    """Both operands rounded to bfloat16, the sums in float32 (float64 here: the kernel's order is its own)."""
    weight = dequantize_rows(packed).to(torch.bfloat16).double()
    out = x.to(torch.bfloat16).double() @ weight.T
    return (out if bias is None else out + bias.double()).float()


@pytest.fixture
def amx():
    if matmul.AMX_ROWS is None or not load_quant().kvq_amx_available():
        pytest.skip("this CPU has no AMX-BF16")


@pytest.mark.parametrize("fmt,k", [("q8_0", 640), ("q8_0", 96), ("q4_k", 512), ("q6_k", 256)])
@pytest.mark.parametrize("rows,n", [(8, 16), (17, 1000), (64, 70), (77, 48)])
def test_equals_bfloat16_reference(amx, fmt, k, rows, n):
    packed = with_amx_copy(pack(fmt, randn(n, k, seed=1)))
    assert packed.amx is not None and packed.amx.shape == (-(-n // 16), k // 32, 16, 16, 2)
    x = randn(rows, k, seed=2)
    out = torch.full((rows, n), float("nan"))
    linear_into(x, packed, None, out)
    torch.testing.assert_close(out, reference(x, packed), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(packed_linear(x, packed), out, atol=0, rtol=0)  # the logits' entry point too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_and_accumulate_into_strided_rows(amx, dtype):
    packed = with_amx_copy(pack("q8_0", randn(40, 64, seed=3)))
    x, bias = randn(20, 64, seed=4).to(dtype), randn(40, seed=5).to(dtype)
    y = randn(20, 90, seed=6).to(dtype)
    expected = y.clone()
    expected[:, :40] += reference(x.float(), packed, bias.float()).to(dtype)
    linear_into(x, packed, bias, y[:, :40], accumulate=True)
    tolerance = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 8e-3}
    torch.testing.assert_close(y, expected, **tolerance)


def test_few_rows_keep_the_integer_kernel(amx):
    plain = pack("q8_0", randn(32, 64, seed=7))
    copied = with_amx_copy(plain)
    x = randn(matmul.AMX_ROWS - 1, 64, seed=8)
    a, b = torch.empty(x.shape[0], 32), torch.empty(x.shape[0], 32)
    linear_into(x, plain, None, a)
    linear_into(x, copied, None, b)
    assert torch.equal(a, b)  # the same integer products, bit for bit
    assert not torch.equal(b, reference(x, copied))  # (which the bfloat16 reference would tell apart)


def test_no_copy_without_amx(monkeypatch):
    monkeypatch.setattr(matmul, "AMX_ROWS", None)
    packed = pack("q8_0", randn(16, 64, seed=9))
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
    add_amx_copies(model, model.logits_module, PACKED_GEMM_LIMIT)
    assert model.embed_tokens.packed.amx is not None  # the (tied) LM head
    assert all(m.packed.amx is not None for m in linears)


def test_model_copies_the_lm_head_alone_when_all_are_over_the_limit(amx):
    model, linears = tiny_packed_model()
    lm_head = 2 * 96 * 64
    add_amx_copies(model, model.logits_module, lm_head)
    assert model.embed_tokens.packed.amx is not None
    assert all(m.packed.amx is None for m in linears)
    model, linears = tiny_packed_model()
    add_amx_copies(model, model.logits_module, lm_head - 1)
    assert model.embed_tokens.packed.amx is None and all(m.packed.amx is None for m in linears)
