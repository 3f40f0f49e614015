"""Idefics3 on the runner: logits equal transformers' with every tile's rows at its placeholders, a chunk
splitting a tile's run; and the frontend's tiling equals transformers' Idefics3 image processor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.tokenizer.multimodal.idefics3 import tiles
from services.worker.multimodal.inputs import ImageInput
from services.worker.setup.build import create_runner, load_model
from tests.worker.tiny import request, run_logits
from tests.worker.tiny_idefics3 import IMAGE_SEQ_LEN, save_tiny_idefics3


def photo(width: int, height: int, seed: int = 0):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8))


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    import transformers

    path = save_tiny_idefics3(str(tmp_path_factory.mktemp("idefics3")))
    processor = transformers.AutoProcessor.from_pretrained(path)
    hf = transformers.Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return path, processor, hf


def test_logits_equal_transformers_over_tiles_and_a_split_chunk(idefics3):
    path, processor, hf = idefics3
    inputs = processor(text="look <image> what?", images=[photo(70, 40)], return_tensors="pt")
    ids = inputs.input_ids[0].tolist()
    with torch.no_grad():
        expected = hf(**inputs).logits[0, -1]
    token = hf.config.image_token_id
    runs = [i for i, t in enumerate(ids) if t == token and ids[i - 1] != token]
    pixels = inputs.pixel_values[0].numpy().astype("<f4")
    assert len(runs) == pixels.shape[0] > 1  # tiles and the global view

    runner = create_runner(load_model(path, dtype="float32", device="cpu"), 16, 64)
    split = runs[1] + IMAGE_SEQ_LEN // 2
    r = request("a", ids, list(range(4)), 0, split)
    r.mm_inputs = [
        ImageInput(f"t{k}", o, IMAGE_SEQ_LEN, pixels[k].shape, pixels[k].tobytes()) for k, o in enumerate(runs)
    ]
    run_logits(runner, [r])
    r.num_scheduled_tokens = len(ids) - split
    torch.testing.assert_close(run_logits(runner, [r])["a"], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("size", [(70, 40), (20, 20), (33, 90), (32, 32)])
@pytest.mark.parametrize("splitting", [True, False])
def test_tiles_equal_transformers(size, splitting):
    import transformers

    hf = transformers.Idefics3ImageProcessor(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=splitting
    )
    settings = {k: v for k, v in hf.to_dict().items() if v is not None}
    image = photo(*size)
    expected = hf(images=[image], return_tensors="np", return_row_col_info=True)
    got, rows, cols = tiles(image, settings)
    assert (rows, cols) == (expected["rows"][0][0], expected["cols"][0][0])
    np.testing.assert_allclose(got, expected["pixel_values"][0], rtol=0, atol=1e-5)
