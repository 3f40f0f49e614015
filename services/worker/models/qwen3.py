"""Qwen3: the Llama layer with an RMSNorm over each query and key head before the rotary embedding.

Its attention is the only difference (``Qwen3Attention``); everything else is ``models.llama``'s.
The native CPU path does not implement the q/k norms, so Qwen3 steps run in torch.
"""

from __future__ import annotations

import torch

from services.worker.attention.base import AttentionBackend
from services.worker.layers.norm import RMSNorm
from services.worker.layers.rope import apply_rotary
from services.worker.models.llama import Attention, DecoderLayer, LlamaArgs, LlamaForCausalLM

ARCHITECTURES = ("Qwen3ForCausalLM",)


class Qwen3Attention(Attention):
    def __init__(self, args: LlamaArgs, backend: AttentionBackend, layer: int = 0):
        super().__init__(args, backend, layer)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)  # one weight shared by every query head
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def rotate_qk(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[T, H + KV, D]: each head normalized over D, then rotated."""
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        qk = torch.cat((self.q_norm.forward(q)[0], self.k_norm.forward(k)[0]), dim=1)
        return apply_rotary(qk, cos, sin)


class Qwen3DecoderLayer(DecoderLayer):
    attention = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer = Qwen3DecoderLayer
    native_cpu = False
