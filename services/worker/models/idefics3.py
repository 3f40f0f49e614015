"""Idefics3 (SmolVLM): a SigLIP-style vision transformer, a pixel-shuffle connector, and a Llama language model.

The frontend splits an image into tiles (and a global view), each its own encoder input with its own run of
placeholders in the prompt, so the worker encodes tiles: [N, 3, S, S] -> [N, (S/patch)^2 / scale^2, E]. Tiles
are always full (the processor resizes images to whole tiles), so no patch is masked.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch
from torch import nn

from services.worker.attention.base import AttentionBackend
from services.worker.models.llama import LlamaArgs, LlamaForCausalLM
from services.worker.models.vision_encoder import VisionArgs, VisionTransformer

ARCHITECTURES = ("Idefics3ForConditionalGeneration",)
VISION_PREFIXES = ("vision_model.", "connector.")


@dataclass(slots=True)
class Idefics3Args(LlamaArgs):
    vision: VisionArgs | None = None
    image_token_id: int = 0
    scale_factor: int = 2

    @classmethod
    def from_hf_config(cls, cfg) -> Idefics3Args:
        text = LlamaArgs.from_hf_config(cfg.text_config)
        return cls(
            **{f.name: getattr(text, f.name) for f in fields(LlamaArgs)},
            vision=VisionArgs.from_hf_config(cfg.vision_config),
            image_token_id=cfg.image_token_id,
            scale_factor=cfg.scale_factor,
        )

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens (and connector rows) per tile."""
        return self.vision.num_patches // self.scale_factor**2


def check_idefics3(cfg) -> None:
    if getattr(cfg.text_config, "model_type", "") not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"an Idefics3 language model of type {cfg.text_config.model_type!r} is not supported")


def full_tile_position_ids(side: int) -> torch.Tensor:  # [side * side]
    """Idefics3's bucketed patch positions for a tile with no masked patch, computed as transformers does."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    step = 1.0 / torch.tensor([side])
    coords = torch.clamp(torch.arange(side, dtype=torch.float32)[None, :] * step[:, None], max=1.0 - 1e-6)[0]
    buckets = torch.bucketize(coords, boundaries, right=True)
    return (buckets[:, None] * side + buckets[None, :]).flatten()


class Connector(nn.Module):
    def __init__(self, args: Idefics3Args):
        super().__init__()
        self.scale = args.scale_factor
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(args.vision.hidden_size * self.scale**2, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, P, C] -> [N, P / scale^2, E]
        n, p, c = x.shape
        side, s = int(p**0.5), self.scale
        x = x.view(n, side, side // s, c * s).permute(0, 2, 1, 3)
        x = x.reshape(n, side // s, side // s, c * s * s).permute(0, 2, 1, 3)
        return self.modality_projection.proj(x.reshape(n, p // (s * s), c * s * s))


class Idefics3ForCausalLM(LlamaForCausalLM):
    native_cpu = False  # steps take image rows as input embeddings, which the native path does not

    def __init__(self, args: Idefics3Args, backend: AttentionBackend):
        super().__init__(args, backend)
        self.vision_model = VisionTransformer(args.vision)
        self.connector = Connector(args)

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, num_image_tokens, E]
        v = self.vision_model
        side = self.args.vision.image_size // self.args.vision.patch_size
        positions = full_tile_position_ids(side).to(pixels.device)
        patches = v.embeddings.patch_embedding(pixels.to(v.embeddings.patch_embedding.weight.dtype))
        x = patches.flatten(2).transpose(1, 2) + v.embeddings.position_embedding(positions)
        for block in v.encoder.layers:
            x = block(x)
        return self.connector(v.post_layernorm(x)).to(self.embed_tokens.weight.dtype)

    def load_extra(self, name: str, tensor) -> set[str]:
        if not name.startswith(VISION_PREFIXES):
            return set()
        params = dict(self.named_parameters())
        if name not in params or params[name].shape != tensor.shape:
            raise ValueError(f"unexpected weight {name!r} {tuple(tensor.shape)} in the checkpoint")
        params[name].data.copy_(tensor)
        return {name}

    def extra_expected(self) -> dict[str, set[str]]:
        return {n: {n} for n, _ in self.named_parameters() if n.startswith(VISION_PREFIXES)}


def rename_idefics3(weights, args: Idefics3Args) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint names -> the names ``Idefics3ForCausalLM`` loads."""
    for name, tensor in weights:
        for old, new in (
            ("model.text_model.", "model."),
            ("model.vision_model.", "vision_model."),
            ("model.connector.", "connector."),
        ):
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        yield name, tensor
