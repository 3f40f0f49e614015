"""A tiny random LLaVA (CLIP vision tower + projector + Llama) with a real processor, written to a directory."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from tests.worker.tiny import save_tiny_bytelevel_tokenizer  # noqa: E402

IMAGE_SIZE = 32  # the vision tower's input side
PATCH_SIZE = 8  # (32 / 8)^2 = 16 patches: 16 placeholder tokens per image
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
VOCAB_SIZE = 320
# Random init makes image rows tiny next to the text's: scaled up, different images lead greedy decoding apart.
PROJECTOR_GAIN = 50.0
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4)
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}\n"
    "{% endfor %}<assistant>"
)


def save_tiny_llava(path: str, seed: int = 0, vision: str = "clip") -> str:
    """Weights, config, tokenizer (byte-level, with ``<image>`` added) and image processor in ``path``; a CLIP
    or a SigLIP (``vision``) tower."""
    import transformers

    path = str(path)
    save_tiny_bytelevel_tokenizer(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    if vision == "siglip":  # no class token: every patch's state feeds the projector
        vision_config = transformers.SiglipVisionConfig(**VISION, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
        image_processor = transformers.SiglipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
        strategy, layer, additional = "full", -1, 0
    else:
        vision_config = transformers.CLIPVisionConfig(
            **VISION, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32
        )
        image_processor = transformers.CLIPImageProcessor(
            size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
        )
        strategy, layer, additional = "default", -2, 1  # CLIP's class token, which "default" drops
    text = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    config = transformers.LlavaConfig(
        vision_config=vision_config,
        text_config=text,
        image_token_index=image_token_id,
        image_seq_length=NUM_IMAGE_TOKENS,
        vision_feature_select_strategy=strategy,
        vision_feature_layer=layer,
    )
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config)
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: perturb them so they are tested
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("multi_modal_projector.linear_2.weight"):
                p.mul_(PROJECTOR_GAIN)
    model.save_pretrained(path, safe_serialization=True)
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=additional,
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
