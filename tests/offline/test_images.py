"""Images offline: ``LLM.generate`` with vLLM's ``multi_modal_data`` and ``LLM.chat`` with image parts equal
transformers' greedy output on a tiny LLaVA with a SigLIP tower; a repeated image hits the prefix cache."""

from __future__ import annotations

import base64

import pytest

from kvgrid import LLM, SamplingParams
from tests.e2e.hf_reference import strip_eos
from tests.e2e.images_reference import LlavaReference, gradient, png, solid
from tests.worker.tiny_llava import save_tiny_llava

MAX_TOKENS = 8
TEXT = "what is it?"


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return save_tiny_llava(str(tmp_path_factory.mktemp("llava")), vision="siglip")


@pytest.fixture(scope="module")
def llm(path) -> LLM:
    return LLM(path, dtype="float32", kv_cache_memory="64MiB", device="cpu", max_num_batched_tokens=20)


@pytest.fixture(scope="module")
def ref(path) -> LlavaReference:
    return LlavaReference(path)


def test_generate_with_multi_modal_data_and_chat_with_image_parts(llm, ref):
    eos = list(llm.engine.core.handshake.eos_token_ids)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    wide, grad = solid((20, 90, 200), (48, 30)), gradient()
    for images in ([wide], [grad, wide]):
        expected = strip_eos(ref.greedy(images, TEXT, MAX_TOKENS, eos), eos)
        prompt = ref.processor.apply_chat_template(
            [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": TEXT}]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, params, use_tqdm=False)
        assert strip_eos(out[0].token_ids, eos) == expected
        content = [{"type": "image_pil", "image_pil": i} for i in images[:-1]]
        url = "data:image/png;base64," + base64.b64encode(png(images[-1])).decode()
        content += [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": TEXT}]
        chat = llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)
        assert strip_eos(chat[0].token_ids, eos) == expected
        assert chat[0].num_cached_tokens > 0  # the same images and text as the generate call


def test_a_prompt_without_its_image_token_is_refused(llm):
    with pytest.raises(ValueError, match="0 image placeholders"):
        llm.generate({"prompt": "no token here", "multi_modal_data": {"image": solid((1, 2, 3))}}, use_tqdm=False)
