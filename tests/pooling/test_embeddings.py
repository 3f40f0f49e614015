"""Embeddings through a real `kvgrid serve --runner pooling`: /v1/embeddings (OpenAI's client and raw HTTP), gRPC
Embed and /v1/models, against transformers' last hidden states pooled the same way, in float32."""

from __future__ import annotations

import base64
import json
import struct
import urllib.error
import urllib.request

import grpc
import pytest
import torch
from openai import OpenAI

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.pooling.conftest import HIDDEN_SIZE, word_prompt

# Mixed lengths in one request (so in the same steps): 1 token to 150 (chunked over 4 steps of the 40-token budget).
LENGTHS = [1, 3, 17, 40, 41, 90, 150]
TEXTS = [word_prompt(i, n) for i, n in enumerate(LENGTHS)]
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def http(pooling_stack) -> str:
    return f"http://127.0.0.1:{pooling_stack.ports['--http-port']}"


@pytest.fixture(scope="module")
def client(http) -> OpenAI:
    return OpenAI(base_url=f"{http}/v1", api_key="unused")


@pytest.fixture(scope="module")
def stub(pooling_stack):
    with grpc.insecure_channel(pooling_stack.addr) as channel:
        yield generate_pb2_grpc.TextGenerationStub(channel)


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def assert_close(got, expected: torch.Tensor) -> None:
    got = torch.tensor(got, dtype=torch.float32)
    assert got.shape == expected.shape
    cosine = torch.nn.functional.cosine_similarity(got, expected, dim=0).item()
    assert cosine >= MIN_COSINE, cosine
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "pooling_type,normalize", [("mean", None), ("last", False), ("cls", True), ("mean", False), ("last", True)]
)
def test_vectors_equal_transformers_pooled(http, reference, pooling_type, normalize):
    body = {"input": TEXTS, "encoding_format": "float", "pooling_type": pooling_type}
    if normalize is not None:
        body["normalize"] = normalize
    status, answer = post(f"{http}/v1/embeddings", body)
    assert status == 200, answer
    assert [d["index"] for d in answer["data"]] == list(range(len(TEXTS)))
    ids = [reference.ids(text) for text in TEXTS]
    assert answer["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    for data, prompt in zip(answer["data"], ids, strict=True):
        # None: the server's --normalize default (on).
        assert_close(data["embedding"], reference.pool(prompt, pooling_type, normalize is not False))


def test_base64_decodes_to_the_same_floats(http, client):
    _, floats = post(f"{http}/v1/embeddings", {"input": TEXTS, "encoding_format": "float"})
    _, encoded = post(f"{http}/v1/embeddings", {"input": TEXTS, "encoding_format": "base64"})
    for f, e in zip(floats["data"], encoded["data"], strict=True):
        raw = base64.b64decode(e["embedding"])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == f["embedding"]
    # OpenAI's own client asks for base64 and decodes it itself.
    response = client.embeddings.create(model=client.models.list().data[0].id, input=TEXTS)
    assert [d.embedding for d in response.data] == [f["embedding"] for f in floats["data"]]


def test_input_forms_and_dimensions(http, reference):
    ids = [reference.ids(text) for text in TEXTS[:3]]
    expected = [reference.pool(p, "mean", True, dimensions=16) for p in ids]
    for given, want in [
        (TEXTS[2], expected[2:3]),
        (TEXTS[:3], expected),
        (ids[1], expected[1:2]),
        (ids, expected),
    ]:
        status, answer = post(f"{http}/v1/embeddings", {"input": given, "dimensions": 16})
        assert status == 200, answer
        assert len(answer["data"]) == len(want)
        for data, vector in zip(answer["data"], want, strict=True):
            assert_close(data["embedding"], vector)


def test_grpc_embed_equals_http(http, stub, reference):
    ids = [reference.ids(text) for text in TEXTS]
    pooling = common_pb2.PoolingParams(pooling_type="cls", dimensions=32)
    by_text = stub.Embed(generate_pb2.EmbedRequest(input=TEXTS, pooling=pooling, request_id="e1"), timeout=120)
    by_ids = stub.Embed(
        generate_pb2.EmbedRequest(input_token_ids=[generate_pb2.TokenIds(token_ids=i) for i in ids], pooling=pooling),
        timeout=120,
    )
    assert by_text.request_id == "e1" and by_text.usage.prompt_tokens == sum(map(len, ids))
    _, answer = post(f"{http}/v1/embeddings", {"input": TEXTS, "pooling_type": "cls", "dimensions": 32})
    for a, b, c, prompt in zip(by_text.data, by_ids.data, answer["data"], ids, strict=True):
        assert list(a.embedding) == list(b.embedding) == c["embedding"]
        assert_close(list(a.embedding), reference.pool(prompt, "cls", True, dimensions=32))


def test_model_info_names_the_pooling_runner(http, stub):
    info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=30)
    assert info.runner == "pooling" and list(info.supported_tasks) == ["embed", "encode"]
    with urllib.request.urlopen(f"{http}/v1/models", timeout=30) as response:
        card = json.loads(response.read())["data"][0]
    assert card["runner"] == "pooling" and card["supported_tasks"] == ["embed", "encode"]


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({"input": "t5", "dimensions": HIDDEN_SIZE + 1}, "dimensions", "hidden size"),
        ({"input": []}, "input", "1 to 2048 inputs"),
        ({"input": ["t5"] * 2049}, "input", "got 2049"),
        ({"input": ""}, "input", "empty"),
        ({"input": [[5, 6], [7, 100000]]}, "input[1][1]", "vocabulary"),
        ({"input": "t5", "encoding_format": "int8"}, "encoding_format", ""),
        ({"input": "t5", "model": "other"}, None, "does not exist"),
        ({"input": "t5 " * 300}, "input", "256"),
    ],
)
def test_bad_embedding_requests_are_400(http, body, param, words):
    status, answer = post(f"{http}/v1/embeddings", body)
    assert status == (404 if "model" in body else 400), answer
    assert answer["error"]["param"] == param, answer
    assert words in answer["error"]["message"]


def test_generation_on_a_pooling_server_is_refused(http, stub):
    status, answer = post(f"{http}/v1/completions", {"prompt": "t5 t6", "max_tokens": 4})
    assert status == 400 and answer["error"]["param"] == "model"
    assert "--runner pooling" in answer["error"]["message"]
    status, answer = post(f"{http}/v1/chat/completions", {"messages": [{"role": "user", "content": "t5"}]})
    assert status == 400 and "embedding model" in answer["error"]["message"]
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(generate_pb2.GenerateRequest(prompt="t5 t6"), timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--runner pooling" in caught.value.details()


def test_embeddings_on_a_generating_server_are_refused(generate_stack):
    http = f"http://127.0.0.1:{generate_stack.ports['--http-port']}"
    status, answer = post(f"{http}/v1/embeddings", {"input": "t5 t6"})
    assert status == 400 and answer["error"]["param"] == "model"
    assert "--runner generate" in answer["error"]["message"]
    with grpc.insecure_channel(generate_stack.addr) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Embed(generate_pb2.EmbedRequest(input=["t5 t6"]), timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=30)
    assert info.runner == "generate" and list(info.supported_tasks) == ["generate"]


def requests_done(http: str) -> float:
    with urllib.request.urlopen(f"{http}/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith("kvgrid_requests_total{") and 'status="stop"' in line
    )


def test_each_embeddings_request_is_counted(http, stub):
    before = requests_done(http)
    post(f"{http}/v1/embeddings", {"input": TEXTS[:2]})
    stub.Embed(generate_pb2.EmbedRequest(input=TEXTS[:2]), timeout=120)
    assert requests_done(http) == before + 2
