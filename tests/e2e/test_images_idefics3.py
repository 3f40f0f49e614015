"""Images through `kvgrid serve` on a tiny random Idefics3 (SmolVLM-style: SigLIP tower, pixel-shuffle connector,
Llama) built here with transformers, its processor splitting images into tiles: float32 greedy output equals
transformers' for one and two images per request, alone and 8 at once."""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.hf_reference import strip_eos
from tests.e2e.images_reference import LlavaReference, gradient, png, solid
from tests.e2e.stack import collect, running_stack
from tests.worker.tiny_idefics3 import save_tiny_idefics3

pytestmark = pytest.mark.slow  # a second served stack; the LLaVA one (test_images.py) runs in every test run

MAX_TOKENS = 10
TEXT = "what is it?"
# tiles: 2 x 2 plus the global view; 2 x 1 plus the global view; one view after resizing to a whole tile
WIDE, TALL, GRAD = solid((250, 40, 10), (70, 40)), solid((10, 40, 250), (30, 90)), gradient()
CASES = [[WIDE], [TALL], [GRAD], [WIDE, TALL], [GRAD, WIDE]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_idefics3(str(tmp_path_factory.mktemp("idefics3")))


@pytest.fixture(scope="module")
def stub(tmp_path_factory, model_dir):
    args = ["--model", model_dir, "--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "1024"]
    args += ["--max-num-batched-tokens", "24", "--max-num-seqs", "16"]
    log = tmp_path_factory.mktemp("idefics3-stack") / "serve.log"
    with running_stack(log, args) as stack, grpc.insecure_channel(stack.addr) as channel:
        yield generate_pb2_grpc.TextGenerationStub(channel)


@pytest.fixture(scope="module")
def ref(model_dir) -> LlavaReference:
    return LlavaReference(model_dir, "Idefics3ForConditionalGeneration")


def chat(stub, images, text: str = TEXT) -> list[int]:
    message = generate_pb2.ChatMessage(role="user", content=text, images=[png(i) for i in images])
    sampling = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    return collect(stub.Chat(generate_pb2.ChatRequest(messages=[message], sampling=sampling)))[1]


def test_greedy_equals_transformers_alone_and_eight_at_once(stub, ref):
    eos = list(stub.GetModelInfo(generate_pb2.GetModelInfoRequest()).eos_token_ids)
    for images in CASES:
        assert strip_eos(chat(stub, images), eos) == strip_eos(ref.greedy(images, TEXT, MAX_TOKENS, eos), eos)
    cases = [(CASES[i % len(CASES)], f"{TEXT} {i}") for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda c: chat(stub, *c), cases))
    for (images, text), ids in zip(cases, results, strict=True):
        assert strip_eos(ids, eos) == strip_eos(ref.greedy(images, text, MAX_TOKENS, eos), eos), text
    assert ref.greedy([WIDE], TEXT, MAX_TOKENS, eos) != ref.greedy([TALL], TEXT, MAX_TOKENS, eos)
