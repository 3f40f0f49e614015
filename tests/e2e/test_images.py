"""Images in, text out, through `kvgrid serve` on a tiny random LLaVA (CLIP tower, projector, Llama) built here
with transformers: float32 greedy output equals transformers' for one and two images per request, alone and 8
at once, over gRPC and HTTP; the same image hits the prefix cache and another never does; bad images are 400 /
INVALID_ARGUMENT naming the part, and the stack serves on.

The step budget (24 tokens) is smaller than a prompt, so chunked prefill splits images' placeholder runs, and two
images (16 placeholders each) never fit one step's encoder budget."""

from __future__ import annotations

import base64
import concurrent.futures

import grpc
import httpx
import pytest

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.hf_reference import strip_eos
from tests.e2e.images_reference import LlavaReference, gradient, huge_png_header, png, solid
from tests.e2e.stack import collect, running_stack, wait_idle
from tests.worker.tiny_llava import save_tiny_llava

MAX_TOKENS = 10
TEXT = "what is it?"
RED, BLUE_WIDE, GRAD = solid((255, 0, 0)), solid((0, 0, 255), (50, 40)), gradient()


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> str:
    return save_tiny_llava(str(tmp_path_factory.mktemp("llava")))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("media")
    (path / "red.png").write_bytes(png(RED))
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory, llava_dir, media_dir):
    args = ["--model", llava_dir, "--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "512"]
    args += ["--max-num-batched-tokens", "24", "--max-num-seqs", "16", "--allowed-local-media-path", str(media_dir)]
    with running_stack(tmp_path_factory.mktemp("images") / "serve.log", args) as s:
        yield s


@pytest.fixture(scope="module")
def ref(llava_dir) -> LlavaReference:
    return LlavaReference(llava_dir)


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.addr) as channel:
        yield generate_pb2_grpc.TextGenerationStub(channel)


@pytest.fixture(scope="module")
def eos_ids(stub) -> list[int]:
    return list(stub.GetModelInfo(generate_pb2.GetModelInfoRequest()).eos_token_ids)


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=f"http://127.0.0.1:{stack.ports['--http-port']}/v1", timeout=120) as client:
        yield client


def chat(stub, images, text: str = TEXT) -> tuple[str, list[int]]:
    message = generate_pb2.ChatMessage(role="user", content=text, images=[png(i) for i in images])
    sampling = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    out, ids, _ = collect(stub.Chat(generate_pb2.ChatRequest(messages=[message], sampling=sampling)))
    return out, ids


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def http_chat(http, parts: list[dict], text: str = TEXT):
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    body["model"] = http.get("/models").json()["data"][0]["id"]
    return http.post("/chat/completions", json=body)


CASES = [[RED], [GRAD], [BLUE_WIDE], [RED, GRAD], [GRAD, BLUE_WIDE]]


def test_greedy_equals_transformers_with_one_and_two_images(stub, ref, eos_ids):
    for images in CASES:
        _, ids = chat(stub, images)
        expected = strip_eos(ref.greedy(images, TEXT, MAX_TOKENS, eos_ids), eos_ids)
        assert strip_eos(ids, eos_ids) == expected, [i.size for i in images]
    assert ref.greedy([RED], TEXT, MAX_TOKENS, eos_ids) != ref.greedy([GRAD], TEXT, MAX_TOKENS, eos_ids)


def test_eight_concurrent_requests_equal_transformers(stub, ref, eos_ids):
    cases = [CASES[i % len(CASES)] for i in range(8)]
    texts = [f"{TEXT} {i}" for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda c: chat(stub, *c)[1], zip(cases, texts, strict=True)))
    for images, text, ids in zip(cases, texts, results, strict=True):
        assert strip_eos(ids, eos_ids) == strip_eos(ref.greedy(images, text, MAX_TOKENS, eos_ids), eos_ids), text


def test_http_image_url_parts_as_data_and_local_file(http, ref, eos_ids, media_dir):
    expected = ref.decode(strip_eos(ref.greedy([RED], TEXT, MAX_TOKENS, eos_ids), eos_ids))
    for url in (data_url(png(RED)), f"file://{media_dir / 'red.png'}"):
        response = http_chat(http, [{"type": "image_url", "image_url": {"url": url}}])
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == expected


def test_the_same_image_hits_the_prefix_cache_and_another_does_not(stack, stub, ref, eos_ids):
    first, second = solid((10, 200, 30)), solid((200, 10, 130))
    text = "describe this picture in detail"
    with grpc.insecure_channel(stack.scheduler_addr) as scheduler:
        before = wait_idle(scheduler).prefix_cache_hits
        _, a = chat(stub, [first], text)
        after_first = wait_idle(scheduler).prefix_cache_hits
        _, again = chat(stub, [first], text)
        after_same = wait_idle(scheduler).prefix_cache_hits
        _, b = chat(stub, [second], text)
        after_other = wait_idle(scheduler).prefix_cache_hits
    assert after_first == before  # nothing of it was seen before (its first block holds the image)
    assert after_same - after_first >= 16  # at least the block with the image
    assert after_other == after_same  # same tokens, another image: no block matches
    assert again == a
    ref_a, ref_b = (strip_eos(ref.greedy([i], text, MAX_TOKENS, eos_ids), eos_ids) for i in (first, second))
    assert (strip_eos(a, eos_ids), strip_eos(b, eos_ids)) == (ref_a, ref_b)
    assert ref_a != ref_b


def truncated_png() -> bytes:
    data = png(GRAD)
    return data[: len(data) // 2]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


# (the parts, built when the test runs; the part the error names; words of the error)
BAD = {
    "truncated": (lambda: [image_part(data_url(truncated_png()))], "content[0]", "readable"),
    "huge-header": (lambda: [image_part(data_url(huge_png_header()))], "content[0]", "pixels than"),
    "over-the-limit": (lambda: [image_part(data_url(png(solid((1, 2, 3), (5000, 4000)))))], "content[0]", "5000x4000"),
    "url-fetching-off": (lambda: [image_part("https://example.com/cat.png")], "content[0]", "off"),
    "file-outside": (lambda: [image_part("file:///etc/passwd")], "content[0]", "outside"),
    "too-many": (lambda: [image_part(data_url(png(RED)))] * 5, "content[4]", "5 images"),
    "bad-base64": (lambda: [image_part("data:image/png;base64,%%%")], "content[0]", "base64"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_images_are_400_naming_the_part(http, case):
    parts, part, words = BAD[case]
    response = http_chat(http, parts())
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert f"messages[0].{part}" in message and words in message, message


def test_bad_image_bytes_over_grpc_are_invalid_argument_and_the_stack_serves_on(stub, ref, eos_ids):
    message = generate_pb2.ChatMessage(role="user", content=TEXT, images=[png(RED), truncated_png()])
    with pytest.raises(grpc.RpcError) as caught:
        collect(stub.Chat(generate_pb2.ChatRequest(messages=[message])))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages[0].images[1]" in caught.value.details()
    _, ids = chat(stub, [RED])
    assert strip_eos(ids, eos_ids) == strip_eos(ref.greedy([RED], TEXT, MAX_TOKENS, eos_ids), eos_ids)


def test_the_worker_reports_its_encoder_cache(stack, stub):
    chat(stub, [RED])
    text = httpx.get(f"http://127.0.0.1:{stack.ports['--worker-metrics-port']}/metrics", timeout=10).text
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvgrid_worker_encoder_")
    }
    assert values["kvgrid_worker_encoder_inputs_encoded"] >= 1
    assert values["kvgrid_worker_encoder_cache_bytes"] > 0
