"""A CLIP / SigLIP vision transformer: image patches -> one hidden state per patch.

Shapes: N images, P patches (plus CLIP's class token), C hidden size. Runs once per image
(the worker caches its output by the image's hash), so it is plain torch with no KV cache.
Names follow the Hugging Face checkpoints (``vision_tower.embeddings.patch_embedding`` ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass(frozen=True, slots=True)
class VisionArgs:
    kind: str  # "clip" (class token, pre-norm) or "siglip" (no class token)
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    act: str

    @classmethod
    def from_hf_config(cls, cfg) -> VisionArgs:
        if cfg.model_type in ("clip_vision_model", "clip"):
            kind = "clip"
        elif cfg.model_type in ("siglip_vision_model", "siglip", "idefics3_vision"):
            kind = "siglip"
        else:
            raise ValueError(f"vision tower {cfg.model_type!r} is not supported (CLIP or SigLIP)")
        act = cfg.hidden_act
        if act not in ACTIVATIONS:
            raise ValueError(f"vision activation {act!r} is not supported")
        return cls(
            kind=kind,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            image_size=cfg.image_size,
            patch_size=cfg.patch_size,
            num_channels=getattr(cfg, "num_channels", 3),
            layer_norm_eps=cfg.layer_norm_eps,
            act=act,
        )

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class Embeddings(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.clip = a.kind == "clip"
        self.patch_embedding = nn.Conv2d(a.num_channels, a.hidden_size, a.patch_size, a.patch_size, bias=not self.clip)
        if self.clip:
            self.class_embedding = nn.Parameter(torch.empty(a.hidden_size))
        self.position_embedding = nn.Embedding(a.num_patches + int(self.clip), a.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, P(+1), C]
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if self.clip:
            cls = self.class_embedding.expand(x.shape[0], 1, -1)
            x = torch.cat([cls, x], dim=1)
        return x + self.position_embedding.weight


class Attention(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.num_heads, self.head_dim = a.num_heads, a.hidden_size // a.num_heads
        self.q_proj = nn.Linear(a.hidden_size, a.hidden_size)
        self.k_proj = nn.Linear(a.hidden_size, a.hidden_size)
        self.v_proj = nn.Linear(a.hidden_size, a.hidden_size)
        self.out_proj = nn.Linear(a.hidden_size, a.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, P, C]
        n, p, c = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [N, P, C] -> [N, heads, P, head_dim]
            return t.view(n, p, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim))  # [N, heads, P, P]
        out = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype) @ v
        return self.out_proj(out.transpose(1, 2).reshape(n, p, c))


class MLP(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.act = ACTIVATIONS[a.act]
        self.fc1 = nn.Linear(a.hidden_size, a.intermediate_size)
        self.fc2 = nn.Linear(a.intermediate_size, a.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)
        self.self_attn = Attention(a)
        self.layer_norm2 = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)
        self.mlp = MLP(a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, a: VisionArgs):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(a) for _ in range(a.num_layers))


class VisionTransformer(nn.Module):
    """``hidden_states(pixels, layer)``: the hidden states Hugging Face's ``output_hidden_states`` gives at
    index ``layer`` (0: the embeddings, after CLIP's pre-norm; negative counts from the end)."""

    def __init__(self, a: VisionArgs):
        super().__init__()
        self.args = a
        self.embeddings = Embeddings(a)
        if a.kind == "clip":
            self.pre_layrnorm = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)  # sic: the checkpoints' name
        self.encoder = Encoder(a)
        self.post_layernorm = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)

    def hidden_states(self, pixels: torch.Tensor, layer: int) -> torch.Tensor:  # [N, 3, S, S] -> [N, P(+1), C]
        num_layers = layer if layer >= 0 else self.args.num_layers + 1 + layer
        x = self.embeddings(pixels)
        if self.args.kind == "clip":
            x = self.pre_layrnorm(x)
        for block in self.encoder.layers[:num_layers]:
            x = block(x)
        return x
