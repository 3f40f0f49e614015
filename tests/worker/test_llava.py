"""The LLaVA family on the runner: logits equal transformers' with image rows at the placeholders, whether a
chunked prefill splits an image's run or not, for CLIP and SigLIP towers; the encoder runs once per image."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.multimodal.encoder_cache import EncoderCache
from services.worker.multimodal.inputs import ImageInput
from services.worker.setup.build import create_runner, load_model
from tests.worker.tiny import request, run_logits
from tests.worker.tiny_llava import NUM_IMAGE_TOKENS, save_tiny_llava


def image(seed: int):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(32, 32, 3) * 255).astype(np.uint8))


@pytest.fixture(scope="module", params=["clip", "siglip"])
def llava(request, tmp_path_factory):
    import transformers

    path = save_tiny_llava(str(tmp_path_factory.mktemp(request.param)), vision=request.param)
    processor = transformers.AutoProcessor.from_pretrained(path)
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return path, processor, hf


def test_logits_equal_transformers_when_a_chunk_splits_the_image(llava):
    path, processor, hf = llava
    inputs = processor(text="look <image> and <image> now", images=[image(0), image(1)], return_tensors="pt")
    ids = inputs.input_ids[0].tolist()
    with torch.no_grad():
        expected = hf(**inputs).logits[0, -1]
    image_token = hf.config.image_token_index
    offsets = [i for i, t in enumerate(ids) if t == image_token and (i == 0 or ids[i - 1] != image_token)]
    assert len(offsets) == 2 and ids.count(image_token) == 2 * NUM_IMAGE_TOKENS

    runner = create_runner(load_model(path, dtype="float32", device="cpu"), 16, 64)
    for split in (len(ids), offsets[0] + 5, offsets[1] + NUM_IMAGE_TOKENS - 1):  # whole; inside each image
        r = request("a", ids, list(range(4)), 0, split)
        pixels = inputs.pixel_values.numpy().astype("<f4")
        r.mm_inputs = [
            ImageInput(f"h{i}-{split}", offset, NUM_IMAGE_TOKENS, tuple(pixels[i].shape), pixels[i].tobytes())
            for i, offset in enumerate(offsets)
        ]
        logits = run_logits(runner, [r])
        if split < len(ids):
            r.num_scheduled_tokens = len(ids) - split
            logits = run_logits(runner, [r])
        torch.testing.assert_close(logits["a"], expected, rtol=1e-4, atol=1e-4)
    assert runner.encoder_cache.num_encoded == 6  # each image of each run once, though chunks split them


def test_the_encoder_cache_is_bounded_in_bytes_and_evicts_the_least_recently_used():
    calls = []

    def encode(pixels):  # [N, 3, 2, 2] -> [N, 4, 8] float32: 128 bytes each
        calls.append(pixels.shape[0])
        return pixels.flatten(1)[:, :4, None].expand(-1, 4, 8).clone()

    cache = EncoderCache(encode, torch.device("cpu"), max_bytes=256)
    pix = [np.full((3, 2, 2), i, dtype="<f4") for i in range(3)]
    images = [ImageInput(f"h{i}", 0, 4, (3, 2, 2), p.tobytes()) for i, p in enumerate(pix)]
    cache.get(images[:2])
    cache.get(images[:1])  # h0 most recent
    cache.get(images[2:])  # evicts h1
    assert ("h0" in cache, "h1" in cache, "h2" in cache) == (True, False, True)
    assert cache.num_bytes == 256 and calls == [2, 1]
    assert cache.get(images[1:2])["h1"][0, 0].item() == 1.0 and calls == [2, 1, 1]  # encoded again
