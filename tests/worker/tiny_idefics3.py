"""A tiny random Idefics3 (SmolVLM-style: SigLIP tower, pixel-shuffle connector, Llama) with its real processor
(image splitting on), written to a directory."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from tests.worker.tiny import save_tiny_bytelevel_tokenizer  # noqa: E402

TILE = 32  # the vision tower's input side (max_image_size); images are resized to at most 2 tiles a side
PATCH_SIZE = 8
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (TILE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # 4 placeholders per tile
VOCAB_SIZE = 320
PROJECTOR_GAIN = 50.0  # as tiny_llava's: images then steer greedy decoding
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>:"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}<assistant>:"
)


def save_tiny_idefics3(path: str, seed: int = 0) -> str:
    import transformers

    path = str(path)
    save_tiny_bytelevel_tokenizer(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    rows = [f"<row_{r}_col_{c}>" for r in range(1, 3) for c in range(1, 3)]
    specials = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>", *rows]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    vision = transformers.Idefics3VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=TILE,
        patch_size=PATCH_SIZE,
    )  # fmt: skip
    text = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )  # fmt: skip
    config = transformers.Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=SCALE_FACTOR,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("modality_projection.proj.weight"):
                p.mul_(PROJECTOR_GAIN)
    model.save_pretrained(path, safe_serialization=True)
    image_processor = transformers.Idefics3ImageProcessor(
        size={"longest_edge": 2 * TILE}, max_image_size={"longest_edge": TILE}
    )
    processor = transformers.Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
