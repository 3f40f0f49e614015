"""Llama RMSNorm, optionally fused with the residual add that precedes it.

Not wired into the model: its speed on CUDA against torch's unfused ops is unmeasured.
With a residual it computes ``h = x + residual`` (rounded to x's dtype, as the unfused model
does), returns ``weight * rms_normalize(h)`` and ``h`` (the next residual), in one pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    out_ptr,  # [num_tokens, hidden]
    residual_out_ptr,  # [num_tokens, hidden], written only when HAS_RESIDUAL
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden], read only when HAS_RESIDUAL
    weight_ptr,  # [hidden]
    eps,
    stride_out,
    stride_residual_out,
    stride_x,
    stride_residual,
    HIDDEN: tl.constexpr,
    HIDDEN_PAD: tl.constexpr,  # next power of two >= HIDDEN
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, HIDDEN_PAD)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / HIDDEN + eps)
    normed = (h * inv_rms).to(x_ptr.dtype.element_ty)
    # Products in float32, then one rounding: what torch does for a 16-bit multiply.
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = weight * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> tuple[torch.Tensor, torch.Tensor | None]:  # normed [num_tokens, hidden], new residual or None
    num_tokens, hidden = x.shape
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("hidden must be the contiguous dimension")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = None if residual is None else torch.empty_like(out)
    if num_tokens == 0:
        return out, residual_out
    rms_norm_kernel[(num_tokens,)](
        out_ptr=out,
        residual_out_ptr=out if residual_out is None else residual_out,
        x_ptr=x,
        residual_ptr=x if residual is None else residual,
        weight_ptr=weight,
        eps=float(eps),
        stride_out=out.stride(0),
        stride_residual_out=0 if residual_out is None else residual_out.stride(0),
        stride_x=x.stride(0),
        stride_residual=0 if residual is None else residual.stride(0),
        HIDDEN=hidden,
        HIDDEN_PAD=triton.next_power_of_2(hidden),
        HAS_RESIDUAL=residual is not None,
    )
    return out, residual_out
