"""Gemma 3 (text): sliding-window and global layers interleaved, each with its own rotary base.

Beside the Llama layer it has: embeddings scaled by sqrt(hidden size) (rounded to the weights' dtype);
Gemma's RMSNorm, which multiplies by (1 + weight) in float32; q/k norms (that RMSNorm per head) before the
rotary embedding; a softmax scale of ``query_pre_attn_scalar ** -0.5``; four norms per layer (before and
after attention and the MLP, the outputs normed before they join the residual stream); a GeGLU MLP (tanh
GELU); and an optional final logit soft cap. Layers whose type is ``sliding_attention`` see the last
``sliding_window`` positions and rotate with ``rope_local_base_freq``'s table; ``full_attention`` ones see
everything and use ``rope_theta``'s (with its scaling). Steps run in torch (the native CPU path is the Llama
layer's), with the native kernels for the norms, the rotary and decodes' attention; a decode-only step whose
products all take native kernels runs its layers in one native call (``gemma3_one_call``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention.base import AttentionBackend, AttentionMetadata
from services.worker.cpu_kernels.library import DTYPE_CODES
from services.worker.layers.rope import apply_rotary, cos_sin_tables
from services.worker.models.gemma3_one_call import GemmaDecodeCall
from services.worker.models.llama import MLP, Attention, LlamaArgs, LlamaForCausalLM, layer_windows

ARCHITECTURES = ("Gemma3ForCausalLM",)


@dataclass(slots=True)
class Gemma3Args(LlamaArgs):
    query_pre_attn_scalar: float = 256.0
    local_rope_theta: float = 10000.0
    local_rope_scaling: dict | None = None
    final_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"

    @classmethod
    def from_hf_config(cls, cfg) -> Gemma3Args:
        if getattr(cfg, "attn_logit_softcapping", None):
            raise ValueError("attention logit soft-capping (Gemma 2) is not supported")
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        full = dict(rope.get("full_attention", rope))
        local = dict(rope.get("sliding_attention", {}))
        local_theta = local.get("rope_theta", getattr(cfg, "rope_local_base_freq", 10000.0))
        num_heads = cfg.num_attention_heads
        return cls(
            architecture="Gemma3ForCausalLM",
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(full.get("rope_theta", getattr(cfg, "rope_theta", 1e6))),
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)),
            qkv_bias=bool(getattr(cfg, "attention_bias", False)),
            o_bias=bool(getattr(cfg, "attention_bias", False)),
            rope_scaling=full,
            layer_windows=layer_windows(cfg),
            query_pre_attn_scalar=float(cfg.query_pre_attn_scalar),
            local_rope_theta=float(local_theta),
            local_rope_scaling=local or {"rope_type": "default"},
            final_logit_softcapping=getattr(cfg, "final_logit_softcapping", None),
            hidden_activation=getattr(cfg, "hidden_activation", None) or "gelu_pytorch_tanh",
        )


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, rounded once to x's dtype (Hugging Face's order of operations)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.eps = eps
        self.native: ctypes.CDLL | None = None  # the decode kernels (use_native_kernels)
        self.scale: torch.Tensor | None = None  # 1 + weight, float32, for the native kernel

    def use_native_kernels(self, lib: ctypes.CDLL | None) -> None:
        """float32 and bfloat16 rows through the native RMSNorm (one call, not torch's eight ops: at one decode row
        a step runs six norms a layer, and their ops' overhead showed beside the layer's products); None: torch."""
        self.native = lib
        self.scale = None if lib is None else (1.0 + self.weight.float()).contiguous()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm's interface: (normed, x) with ``residual`` added into x first."""
        if residual is not None:
            x = x.add_(residual)
        if self.native is not None and x.dtype in NATIVE_CODES and x.is_contiguous() and x.device.type == "cpu":
            out = torch.empty_like(x)
            self.into(x.data_ptr(), out.data_ptr(), x.numel() // self.scale.shape[0], x.dtype)
            return out, x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype), x

    def into(self, at: int, to: int, rows: int, dtype: torch.dtype) -> None:
        """The native norm of ``rows`` contiguous rows of ``dtype`` at address ``at`` into ``to`` (may be ``at``)."""
        size, code = self.scale.shape[0], NATIVE_CODES[dtype]
        self.native.kvg_rms_norm_scaled(at, self.scale.data_ptr(), to, rows, size, self.eps, code)


# Rows the native norm and rotary take, and their dtype codes.
NATIVE_CODES = {torch.float32: DTYPE_CODES["float32"], torch.bfloat16: DTYPE_CODES["bfloat16"]}
_POSITION_0 = torch.zeros(1, dtype=torch.int64)  # kvg_rope_write_kv's position into a one-row table


class Gemma3Attention(Attention):
    def __init__(self, args: Gemma3Args, backend: AttentionBackend, layer: int = 0):
        super().__init__(args, backend, layer)
        self.q_norm = GemmaRMSNorm(args.head_dim, args.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(args.head_dim, args.rms_norm_eps)
        self.scale = args.query_pre_attn_scalar**-0.5

    def forward(self, x, cos, sin, kv_cache, meta) -> torch.Tensor:  # [T, E] -> [T, E]
        """One decode row in float32 or bfloat16 with the native kernels (GemmaRMSNorm.use_native_kernels): q/k
        norms in place, rotary and the KV write in one call each (as the Llama layer's native path), not torch's
        dozen small ops."""
        lib, dtype = self.q_norm.native, x.dtype
        if lib is None or x.shape[0] != 1 or dtype not in NATIVE_CODES or kv_cache[0].dtype != dtype:
            return super().forward(x, cos, sin, kv_cache, meta)
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj.forward(x)  # [1, (H + 2 KV) D], contiguous
        at = qkv.data_ptr()
        self.q_norm.into(at, at, H, dtype)
        k_at = at + H * D * qkv.element_size()
        self.k_norm.into(k_at, k_at, KV, dtype)
        k_cache, v_cache = kv_cache
        # cos, sin: [1, 1, D], this row's: a table of one position, position 0
        lib.kvg_rope_write_kv(
            at, qkv.stride(0), cos.data_ptr(), sin.data_ptr(), _POSITION_0.data_ptr(), meta.slot_mapping.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), 1, H, KV, D, NATIVE_CODES[dtype],
        )  # fmt: skip
        q = qkv[:, : self.q_size].view(1, H, D)
        out = self.backend.forward(q, k_cache, v_cache, meta, self.scale, self.window)  # [1, H, D]
        out = self.o_proj.forward(out.reshape(1, self.q_size))
        return out if self.all_reduce is None else self.all_reduce(out)

    def rotate_qk(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[T, H + KV, D]: each head normalized over D, then rotated. The heads are made contiguous so that the
        norms take the native kernel as one row's do (Gemma3Attention.forward): a row's result does not depend on
        how many rows share its step."""
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        qk = torch.cat((self.q_norm.forward(q.contiguous())[0], self.k_norm.forward(k.contiguous())[0]), dim=1)
        return apply_rotary(qk, cos, sin)


class GeGLU(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, E] -> [T, E]
        gate, up = self.gate_up_proj.forward(x).split(self.intermediate_size, dim=-1)  # [T, I] each
        out = self.down_proj.forward(F.gelu(gate, approximate="tanh").mul_(up))
        return out if self.all_reduce is None else self.all_reduce(out)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, args: Gemma3Args, backend: AttentionBackend, layer: int = 0):
        super().__init__()
        E, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(E, eps)
        self.self_attn = Gemma3Attention(args, backend, layer)
        self.post_attention_layernorm = GemmaRMSNorm(E, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(E, eps)
        self.mlp = GeGLU(args)
        self.post_feedforward_layernorm = GemmaRMSNorm(E, eps)

    def forward(self, x, cos, sin, kv_cache, meta) -> torch.Tensor:  # [T, E] residual stream in and out
        h = self.self_attn.forward(self.input_layernorm.forward(x)[0], cos, sin, kv_cache, meta)
        x = x + self.post_attention_layernorm.forward(h)[0]
        h = self.mlp.forward(self.pre_feedforward_layernorm.forward(x)[0])
        return x + self.post_feedforward_layernorm.forward(h)[0]


class Gemma3ForCausalLM(LlamaForCausalLM):
    decoder_layer = Gemma3DecoderLayer
    native_cpu = False
    args: Gemma3Args

    def __init__(self, args: Gemma3Args, backend: AttentionBackend):
        if args.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(f"Gemma 3 with hidden_activation {args.hidden_activation!r} is not supported")
        super().__init__(args, backend)
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.local_cos: torch.Tensor | None = None  # the sliding-window layers' tables, see init_rope
        self.local_sin: torch.Tensor | None = None
        self.decode_call: GemmaDecodeCall | None = None  # decode steps' layers in one native call (use_native_kernels)

    def use_native_kernels(self, lib: ctypes.CDLL | None) -> None:
        """Decode steps' layers through one native call where their products allow it (``gemma3_one_call``); None:
        torch, op by op."""
        dtype = self.embed_tokens.weight.dtype
        self.decode_call = GemmaDecodeCall(self, lib) if lib is not None and dtype in NATIVE_CODES else None

    def init_rope(self) -> None:
        super().init_rope()
        a, w = self.args, self.embed_tokens.weight
        self.local_cos, self.local_sin = cos_sin_tables(
            a.head_dim, a.local_rope_theta, a.local_rope_scaling, a.max_position_embeddings, w.dtype, w.device
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, E] hidden states before the final norm
        x = self.embed_tokens.forward(input_ids)
        x = x * torch.tensor(self.args.hidden_size**0.5, dtype=x.dtype)  # the scale rounded to the dtype, as HF
        if self.decode_call is not None and self.decode_call.takes(x, meta):
            return self.decode_call.forward(x, positions, kv_caches, meta)
        tables = {
            False: (self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)),
            True: (
                self.local_cos.index_select(0, positions).unsqueeze(1),
                self.local_sin.index_select(0, positions).unsqueeze(1),
            ),
        }  # [T, 1, D] each, by "the layer slides"
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            cos, sin = tables[layer.self_attn.window > 0]
            x = layer.forward(x, cos, sin, kv_cache, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, E] -> [R, vocab]
        logits = super().compute_logits(hidden)
        cap = self.args.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap
