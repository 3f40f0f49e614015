"""Mixture-of-experts feed-forward as grouped GEMMs: each expert multiplies only the tokens routed to it.

The (token, slot) pairs of the top-k routing are sorted by expert and each expert's run padded to a multiple of
``BLOCK_M`` (``align_by_expert``), so one program's ``BLOCK_M`` rows all go to one expert, whose weight tile it
reads once for them. Two launches of ``fused_moe_kernel``: the gate/up product of every pair ([T*k, 2I]), and,
after SiLU(gate) * up, the down product scaled by each pair's routing weight ([T*k, E]); the k rows of a token
are summed at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def fused_moe_kernel(
    c_ptr,  # [num_pairs, N] output rows, one per (token, slot) pair
    a_ptr,  # [num_pairs // A_DIV, K] input rows
    b_ptr,  # [num_experts, N, K] expert weights
    weights_ptr,  # [num_pairs] float32 routing weights, read when MUL_WEIGHT
    sorted_ids_ptr,  # [num_padded] int32 pair ids grouped by expert; num_pairs marks padding
    block_expert_ptr,  # [num_padded // BLOCK_M] int32 expert of each row block
    num_pairs,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    A_DIV: tl.constexpr,  # pair p reads input row p // A_DIV (top_k for the first product, 1 for the second)
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 (no tf32 rounding)
    DOT_IN_FP32: tl.constexpr,  # upcast dot operands: the interpreter's tl.dot misreads bfloat16 (triton#11584)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rows)  # [BLOCK_M]
    valid = pair < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    a_rows = (pair // A_DIV).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & k_valid[None, :], other=0.0
        )
        b_offsets = expert * stride_be + cols[None, :].to(tl.int64) * stride_bn + ks[:, None]
        b = tl.load(b_ptr + b_offsets, mask=k_valid[:, None] & col_valid[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pair, mask=valid, other=0.0)[:, None]
    c_offsets = pair[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c_ptr + c_offsets, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & col_valid[None, :])


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair ids [num_padded] int32, expert of each block of ``block_m`` [num_padded // block_m] int32).

    Pair p is (token p // k, slot p % k). Each expert's pairs run in token order, padded with num_pairs up to a
    multiple of ``block_m``; experts with no pair get no block."""
    flat = topk_ids.flatten().long()
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    ids, experts, start = [], [], 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        num_blocks = -(-count // block_m)
        run = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int64, device=flat.device)
        run[:count] = order[start : start + count]
        ids.append(run)
        experts += [expert] * num_blocks
        start += count
    return torch.cat(ids).int(), torch.tensor(experts, dtype=torch.int32, device=flat.device)


def _grouped_gemm(a, b, sorted_ids, block_experts, num_pairs, a_div, weights, block_m) -> torch.Tensor:
    """[num_pairs, N]: row p = a[p // a_div] @ b[expert of p].T (times weights[p] when given)."""
    num_experts, n, k = b.shape
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    interpreted = isinstance(fused_moe_kernel, InterpretedFunction)
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    fused_moe_kernel[grid](
        c_ptr=out,
        a_ptr=a,
        b_ptr=b,
        weights_ptr=weights if weights is not None else out,
        sorted_ids_ptr=sorted_ids,
        block_expert_ptr=block_experts,
        num_pairs=num_pairs,
        N=n,
        K=k,
        stride_am=a.stride(0),
        stride_be=b.stride(0),
        stride_bn=b.stride(1),
        stride_cm=out.stride(0),
        A_DIV=a_div,
        MUL_WEIGHT=weights is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=a.dtype == torch.bfloat16 and interpreted,
    )
    return out


def fused_moe(
    x: torch.Tensor,  # [T, E]
    w13: torch.Tensor,  # [num_experts, 2 * I, E], gate rows then up rows
    w2: torch.Tensor,  # [num_experts, E, I]
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k] int
    block_m: int = 16,
) -> torch.Tensor:  # [T, E]
    """sum over the k experts e_j of token t: w_j * down_e(silu(gate_e(x_t)) * up_e(x_t))."""
    if x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("the hidden and intermediate dimensions must be contiguous")
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    num_pairs = num_tokens * top_k
    sorted_ids, block_experts = align_by_expert(topk_ids, w13.shape[0], block_m)
    gate_up = _grouped_gemm(x, w13, sorted_ids, block_experts, num_pairs, top_k, None, block_m)  # [T*k, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    act = (F.silu(gate) * up).contiguous()  # [T*k, I]
    weights = topk_weights.reshape(-1).float().contiguous()
    down = _grouped_gemm(act, w2, sorted_ids, block_experts, num_pairs, 1, weights, block_m)  # [T*k, E]
    return down.view(num_tokens, top_k, -1).sum(dim=1)
