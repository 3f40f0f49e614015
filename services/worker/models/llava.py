"""LLaVA: a vision transformer, a two-layer projector, and a Llama-family language model.

Images are encoded apart from the language model's step (``encode_images``, once per image, see
``services.worker.multimodal``); the step then takes the projected rows in place of the token
embeddings at the image's placeholder positions (``LlamaForCausalLM.forward``'s ``inputs_embeds``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch
from torch import nn

from services.worker.attention.base import AttentionBackend
from services.worker.models.llama import LlamaArgs, LlamaForCausalLM
from services.worker.models.vision_encoder import ACTIVATIONS, VisionArgs, VisionTransformer

ARCHITECTURES = ("LlavaForConditionalGeneration",)
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


@dataclass(slots=True)
class LlavaArgs(LlamaArgs):
    vision: VisionArgs | None = None
    image_token_id: int = 0
    feature_layer: int = -2  # which hidden states of the vision tower feed the projector
    drop_class_token: bool = True  # vision_feature_select_strategy "default" (CLIP's class token dropped)
    projector_act: str = "gelu"
    projector_bias: bool = True

    @classmethod
    def from_hf_config(cls, cfg) -> LlavaArgs:
        text = LlamaArgs.from_hf_config(cfg.text_config)
        layer = cfg.vision_feature_layer
        if not isinstance(layer, int):
            raise ValueError("vision_feature_layer as a list of layers is not supported")
        if cfg.projector_hidden_act not in ACTIVATIONS:
            raise ValueError(f"projector activation {cfg.projector_hidden_act!r} is not supported")
        vision = VisionArgs.from_hf_config(cfg.vision_config)
        return cls(
            **{f.name: getattr(text, f.name) for f in fields(LlamaArgs)},
            vision=vision,
            image_token_id=cfg.image_token_index,
            feature_layer=layer,
            drop_class_token=cfg.vision_feature_select_strategy == "default" and vision.kind == "clip",
            projector_act=cfg.projector_hidden_act,
            projector_bias=bool(getattr(cfg, "multimodal_projector_bias", True)),
        )

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens (and projected rows) per image."""
        return self.vision.num_patches


def check_llava(cfg) -> None:
    if getattr(cfg.text_config, "model_type", "") not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"a LLaVA language model of type {cfg.text_config.model_type!r} is not supported")


class Projector(nn.Module):
    def __init__(self, args: LlavaArgs):
        super().__init__()
        v, bias = args.vision, args.projector_bias
        self.linear_1 = nn.Linear(v.hidden_size, args.hidden_size, bias=bias)
        self.act = ACTIVATIONS[args.projector_act]
        self.linear_2 = nn.Linear(args.hidden_size, args.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, P, C] -> [N, P, E]
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForCausalLM(LlamaForCausalLM):
    native_cpu = False  # steps take image rows as input embeddings, which the native path does not

    def __init__(self, args: LlavaArgs, backend: AttentionBackend):
        super().__init__(args, backend)
        self.vision_tower = VisionTransformer(args.vision)
        self.multi_modal_projector = Projector(args)

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, num_image_tokens, E]
        a = self.args
        states = self.vision_tower.hidden_states(pixels, a.feature_layer)
        if a.drop_class_token:
            states = states[:, 1:]
        return self.multi_modal_projector(states).to(self.embed_tokens.weight.dtype)

    def load_extra(self, name: str, tensor) -> set[str]:
        if not name.startswith(VISION_PREFIXES):
            return set()
        if name.startswith("vision_tower.head."):
            return {name}  # SigLIP's pooling head: LLaVA reads the tower's hidden states, never its pooled output
        params = dict(self.named_parameters())
        if name not in params:
            raise ValueError(f"unexpected weight {name!r} in the checkpoint")
        if params[name].shape != tensor.shape:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
        params[name].data.copy_(tensor)
        return {name}

    def extra_expected(self) -> dict[str, set[str]]:
        return {n: {n} for n, _ in self.named_parameters() if n.startswith(VISION_PREFIXES)}


def rename_llava(weights, args: LlavaArgs) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint names of either transformers layout -> the names ``LlavaForCausalLM`` loads."""
    for name, tensor in weights:
        for old, new in (
            ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."),
            ("model.language_model.", "model."),
            ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."),
        ):
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        yield name, tensor
