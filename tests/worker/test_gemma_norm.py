"""Gemma's RMSNorm on the native kernel (``GemmaRMSNorm.use_native_kernels``) equals its torch form: float32 and
bfloat16 rows of any leading shape (bfloat16 within one rounding of it, on a few values at most: the sum of squares
runs in its own order), the residual added first; other dtypes and strided rows keep torch."""

from __future__ import annotations

import pytest
import torch

from services.worker.cpu_kernels.library import NativeKernelsUnavailable, load
from services.worker.models.gemma3 import GemmaRMSNorm


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def lib():
    try:
        return load()
    except NativeKernelsUnavailable as exc:
        pytest.skip(str(exc))


def norms(size: int, lib) -> tuple[GemmaRMSNorm, GemmaRMSNorm]:
    plain, native = GemmaRMSNorm(size, 1e-6), GemmaRMSNorm(size, 1e-6)
    weight = randn(size, seed=1)
    plain.weight.data.copy_(weight)
    native.weight.data.copy_(weight)
    native.use_native_kernels(lib)
    return plain, native


@pytest.mark.parametrize("shape", [(1, 640), (7, 640), (1, 5, 256), (3, 5, 256)])
def test_equals_torch(lib, shape):
    plain, native = norms(shape[-1], lib)
    x = randn(*shape, seed=2) * 3
    expected, _ = plain.forward(x.clone())
    got, same = native.forward(x)
    assert same is x
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.equal(got, x)


@pytest.mark.parametrize("shape", [(1, 640), (7, 640), (3, 5, 256)])
def test_bfloat16_within_one_rounding_of_torch(lib, shape):
    plain, native = norms(shape[-1], lib)
    x = (randn(*shape, seed=2) * 3).bfloat16()
    expected, _ = plain.forward(x.clone())
    got, _ = native.forward(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, atol=0, rtol=2**-8)  # one bfloat16 step
    assert (got != expected).sum() <= 2


def test_adds_the_residual_first(lib):
    plain, native = norms(640, lib)
    x, residual = randn(4, 640, seed=3), randn(4, 640, seed=4)
    expected, summed = plain.forward(x.clone(), residual)
    got, added = native.forward(x, residual)
    torch.testing.assert_close(added, summed, atol=0, rtol=0)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_strided_and_float16_rows_keep_torch(lib):
    plain, native = norms(256, lib)
    x = randn(2, 6, 256, seed=5)[:, :4]  # a view of every row's first four heads: not contiguous
    torch.testing.assert_close(native.forward(x)[0], plain.forward(x)[0], atol=0, rtol=0)
    y = randn(3, 256, seed=6).half()
    torch.testing.assert_close(native.forward(y)[0], plain.forward(y)[0], atol=0, rtol=0)
