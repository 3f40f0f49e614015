"""Images for the image tests, and transformers' greedy output on the tiny LLaVA for a chat with images."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image


def solid(color: tuple[int, int, int], size: tuple[int, int] = (32, 32)) -> Image.Image:
    return Image.new("RGB", size, color)


def gradient() -> Image.Image:
    a = np.zeros((32, 32, 3), np.uint8)
    a[..., 0] = np.arange(32)[None, :] * 8
    a[..., 2] = np.arange(32)[:, None] * 8
    return Image.fromarray(a)


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def huge_png_header(width: int = 20000, height: int = 20000) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` pixels (its data is one tiny row): costs nothing to build,
    and a reader that trusted the header would allocate gigabytes."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 4)) + chunk(b"IEND", b"")


class LlavaReference:
    """transformers' model (``architecture``) and processor in float32."""

    def __init__(self, path: str, architecture: str = "LlavaForConditionalGeneration"):
        import torch
        import transformers

        self.processor = transformers.AutoProcessor.from_pretrained(path)
        model_class = getattr(transformers, architecture)
        self.model = model_class.from_pretrained(path, dtype=torch.float32).eval()
        self._cache: dict = {}

    def greedy(self, images: list[Image.Image], text: str, max_new_tokens: int, eos_ids: list[int]) -> list[int]:
        """The images then the text in one user message, through the processor's chat template; the output ends at
        (and includes) the first EOS id."""
        import torch

        key = (tuple(png(i) for i in images), text, max_new_tokens)
        if key not in self._cache:
            content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
            prompt = self.processor.apply_chat_template(
                [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
            )
            inputs = self.processor(text=prompt, images=images, return_tensors="pt")
            with torch.inference_mode():
                out = self.model.generate(
                    **inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_ids, pad_token_id=0
                )
            self._cache[key] = out[0, inputs.input_ids.shape[1] :].tolist()
        return list(self._cache[key])

    def decode(self, ids: list[int]) -> str:
        return self.processor.tokenizer.decode(ids, skip_special_tokens=True)
