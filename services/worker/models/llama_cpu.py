"""The Llama decode step on the native CPU kernels, for steps of a few single-token requests.

At batch 1 a decode step on a CPU is ~120 matrix-vector products plus ~20 small ops per
layer. torch's bfloat16 matrix-vector product reaches about half the memory bandwidth here,
and each small eager op costs 2-20 us of dispatch; ``cpu_kernels/decode_kernels.c`` streams
the weights at close to bandwidth and does each small op in one call, 9 calls per layer.
Larger steps (prefill chunks, many decodes) are matrix-matrix products where torch is the
faster path, so ``LlamaForCausalLM`` sends only decode-only steps of at most ``max_seqs``
requests here. Same weights, same KV cache, same numerics op for op (see the C file).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from ..attention.base import AttentionMetadata
from ..cpu_kernels.library import DTYPE_CODES

# The largest decode step taken here. Measured on a 2-core AVX2 CPU against the torch path:
# bf16 1.7x at 8 requests, 1.4x at 16, 0.9x at 24; float32 still 1.2x at 24.
MAX_SEQS = 16


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class CpuDecodePath:
    """Raw pointers to the model's weights, taken once; valid while the model keeps its parameters."""

    def __init__(self, model, lib: ctypes.CDLL, max_seqs: int = MAX_SEQS):
        a = model.args
        dtype = model.embed_tokens.weight.dtype
        dtype_name = str(dtype).removeprefix("torch.")
        if dtype_name not in DTYPE_CODES:
            raise ValueError(f"the native CPU kernels take float32 or bfloat16 weights, not {dtype}")
        group = a.num_heads // a.num_kv_heads
        if a.head_dim % 2 or a.head_dim > 1024 or a.num_heads % a.num_kv_heads or group > 16:
            raise ValueError(
                f"the native CPU kernels take an even head_dim up to 1024 and up to 16 query heads per KV head,"
                f" not head_dim {a.head_dim} with {a.num_heads} query and {a.num_kv_heads} KV heads"
            )
        self.lib, self.model, self.max_seqs = lib, model, max_seqs
        self.dtype, self.code = dtype, DTYPE_CODES[dtype_name]
        self.hidden, self.intermediate = a.hidden_size, a.intermediate_size
        self.heads, self.kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.qkv_width = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
        self.eps = a.rms_norm_eps
        self.scale = a.head_dim**-0.5
        self.layers = [
            (
                _ptr(layer.input_layernorm.weight),
                _ptr(layer.self_attn.qkv_proj.weight),
                _ptr(layer.self_attn.qkv_proj.bias),
                _ptr(layer.self_attn.o_proj.weight),
                _ptr(layer.self_attn.o_proj.bias),
                _ptr(layer.post_attention_layernorm.weight),
                _ptr(layer.mlp.gate_up_proj.weight),
                _ptr(layer.mlp.gate_up_proj.bias),
                _ptr(layer.mlp.down_proj.weight),
                _ptr(layer.mlp.down_proj.bias),
            )
            for layer in model.layers
        ]
        for p in model.parameters():
            if not p.is_contiguous() or p.device.type != "cpu":
                raise ValueError("the native CPU kernels need contiguous CPU weights")
        self._scratch: dict[int, tuple[torch.Tensor, ...]] = {}

    def takes(self, meta: AttentionMetadata) -> bool:
        return meta.is_decode_only and meta.num_seqs <= self.max_seqs

    def scratch(self, rows: int) -> tuple[torch.Tensor, ...]:
        """Per-step intermediates (normed, qkv, attention out, gate_up, activation), kept per row count."""
        buffers = self._scratch.get(rows)
        if buffers is None:
            shapes = (self.hidden, self.qkv_width, self.heads * self.head_dim, 2 * self.intermediate, self.intermediate)
            buffers = tuple(torch.empty(rows, n, dtype=self.dtype) for n in shapes)
            self._scratch[rows] = buffers
        return buffers

    def forward(
        self,
        input_ids: torch.Tensor,  # [B] int64, one token per request
        positions: torch.Tensor,  # [B] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [B, E] hidden states before the final norm
        lib, dt = self.lib, self.code
        lib.kvg_set_num_threads(torch.get_num_threads())
        rows = input_ids.shape[0]
        E, I, H, KV, D = self.hidden, self.intermediate, self.heads, self.kv_heads, self.head_dim
        hidden = F.embedding(input_ids, self.model.embed_tokens.weight)  # the residual stream
        normed, qkv, attn, gate_up, act = self.scratch(rows)
        h, n, q, o, gu, ac = (t.data_ptr() for t in (hidden, normed, qkv, attn, gate_up, act))
        cos, sin = self.model.cos.data_ptr(), self.model.sin.data_ptr()
        pos, slots = positions.data_ptr(), meta.slot_mapping.data_ptr()
        tables, lens, table_width = meta.block_tables.data_ptr(), meta.seq_lens.data_ptr(), meta.block_tables.shape[1]
        block_size = kv_caches[0][0].shape[1]
        width = self.qkv_width
        for (w_in, w_qkv, b_qkv, w_o, b_o, w_post, w_gu, b_gu, w_down, b_down), (k_cache, v_cache) in zip(
            self.layers, kv_caches, strict=True
        ):
            kc, vc = k_cache.data_ptr(), v_cache.data_ptr()
            lib.kvg_rms_norm(h, w_in, n, rows, E, self.eps, dt)
            lib.kvg_linear(n, w_qkv, b_qkv, q, width, rows, width, E, dt, 0)
            lib.kvg_rope_write_kv(q, width, cos, sin, pos, slots, kc, vc, rows, H, KV, D, dt)
            lib.kvg_decode_attention(
                q, width, kc, vc, tables, table_width, lens, o, H * D, rows, H, KV, D, block_size, self.scale, dt
            )
            lib.kvg_linear(o, w_o, b_o, h, E, rows, E, H * D, dt, 1)
            lib.kvg_rms_norm(h, w_post, n, rows, E, self.eps, dt)
            lib.kvg_linear(n, w_gu, b_gu, gu, 2 * I, rows, 2 * I, E, dt, 0)
            lib.kvg_silu_mul(gu, ac, rows, I, dt)
            lib.kvg_linear(ac, w_down, b_down, h, E, rows, E, I, dt, 1)
        return hidden

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [R, E] -> [R, vocab]
        hidden = hidden.contiguous()
        rows, vocab = hidden.shape[0], weight.shape[0]
        normed = torch.empty_like(hidden)
        out = torch.empty(rows, vocab, dtype=self.dtype)
        norm = self.model.norm.weight.data_ptr()
        self.lib.kvg_set_num_threads(torch.get_num_threads())
        self.lib.kvg_rms_norm(hidden.data_ptr(), norm, normed.data_ptr(), rows, self.hidden, self.eps, self.code)
        self.lib.kvg_linear(
            normed.data_ptr(), weight.data_ptr(), None, out.data_ptr(), vocab, rows, vocab, self.hidden, self.code, 0
        )
        return out
