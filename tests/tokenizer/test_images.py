"""The frontend's images: processing equals transformers' image processors, where an image may come from, the
limits, and the placeholder expansion."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from PIL import Image

from services.common.errors import InvalidArgument
from services.tokenizer.multimodal.images import ImageInputs, ImageSource, ImageSpec, split_images
from services.tokenizer.multimodal.media import MediaPolicy
from services.tokenizer.multimodal.processor import preprocess
from tests.e2e.images_reference import huge_png_header, png


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8))


@pytest.mark.parametrize("size", [(50, 40), (30, 70), (32, 32)])
@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_preprocess_equals_transformers(kind, size):
    import transformers

    if kind == "clip":
        hf = transformers.CLIPImageProcessor(size={"shortest_edge": 24}, crop_size={"height": 24, "width": 24})
    else:
        hf = transformers.SiglipImageProcessor(size={"height": 24, "width": 24})
    settings = {k: v for k, v in hf.to_dict().items() if v is not None}
    image = photo(*size)
    expected = hf(images=image, return_tensors="np").pixel_values[0]
    got = preprocess(image, json.loads(json.dumps(settings)))
    assert got.shape == expected.shape == (3, 24, 24)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


def test_image_sources_and_their_refusals(tmp_path):
    (tmp_path / "ok.png").write_bytes(png(photo(4, 4)))
    policy = MediaPolicy(allowed_local_media_path=str(tmp_path))
    data = png(photo(4, 4))
    assert policy.read_url("data:image/png;base64," + base64.b64encode(data).decode(), "p") == data
    assert policy.read_url(f"file://{tmp_path / 'ok.png'}", "p") == data
    cases = {
        "https://example.com/a.png": "--allowed-media-domains",
        "file:///etc/hostname": "outside",
        f"file://{tmp_path / 'missing.png'}": "no such",
        "ftp://x/y.png": "scheme",
        "data:image/png,abc": "base64",
    }
    for url, words in cases.items():
        with pytest.raises(InvalidArgument, match=words) as caught:
            policy.read_url(url, "messages[0].content[1]")
        assert caught.value.field == "messages[0].content[1]"
    with pytest.raises(InvalidArgument, match="local image files are off"):
        MediaPolicy().read_url(f"file://{tmp_path / 'ok.png'}", "p")


def test_the_pixel_count_is_refused_from_the_header():
    policy = MediaPolicy(max_image_pixels=100)
    with pytest.raises(InvalidArgument, match="11x10 pixels"):
        policy.decode(png(photo(11, 10)), "p")
    with pytest.raises(InvalidArgument, match="more pixels"):
        policy.decode(huge_png_header(), "p")
    with pytest.raises(InvalidArgument, match="readable"):
        policy.decode(png(photo(8, 8))[:40], "p")


SPEC = ImageSpec("<image>", 7, 3, {"size": {"height": 4, "width": 4}})


def test_placeholders_expand_to_each_image_run_in_order():
    inputs = ImageInputs(SPEC, MediaPolicy(max_images=2))
    processed = inputs.process([ImageSource("a", photo(5, 5, 1)), ImageSource("b", png(photo(5, 5, 2)))])
    ids, mm = inputs.expand([1, 7, 2, 7, 3], processed, "prompt")
    assert ids == [1, 7, 7, 7, 2, 7, 7, 7, 3]
    assert [(m.offset, m.length, list(m.shape)) for m in mm] == [(1, 3, [3, 4, 4]), (5, 3, [3, 4, 4])]
    assert mm[0].mm_hash != mm[1].mm_hash
    assert inputs.process([ImageSource("a", photo(5, 5, 1))])[0].mm_hash == mm[0].mm_hash
    with pytest.raises(InvalidArgument, match="2 image placeholders"):
        inputs.expand([7, 7], processed[:1], "prompt")
    with pytest.raises(InvalidArgument, match="3 images") as caught:
        inputs.process([ImageSource(f"c[{i}]", photo(2, 2)) for i in range(3)])
    assert caught.value.field == "c[2]"
    with pytest.raises(InvalidArgument, match="text only"):
        ImageInputs(None, MediaPolicy()).process([ImageSource("x", photo(2, 2))])


def test_chat_parts_become_image_stand_ins_and_sources():
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "see"},
                {"type": "image_url", "image_url": {"url": "data:x"}},
                {"type": "image", "image": b"png", "field": "messages[1].images[0]"},
            ],
        },
    ]
    out, sources = split_images(messages, "messages")
    assert out[1]["content"] == [{"type": "text", "text": "see"}, {"type": "image"}, {"type": "image"}]
    assert [(s.field, s.value) for s in sources] == [
        ("messages[1].content[1]", "data:x"),
        ("messages[1].images[0]", b"png"),
    ]
