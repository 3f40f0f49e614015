"""LoRA through `kvgrid serve` on the tiny random Llama: each adapter and the base alone and all mixed in 16
concurrent requests equal peft's PeftModel (float32 greedy); adapters never share prefix-cache blocks (GetStats);
the OpenAI `model` field names an adapter; runtime load and unload (--allow-runtime-lora)."""

from __future__ import annotations

import concurrent.futures

import grpc
import httpx
import pytest

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.stack import collect, get_stats, running_stack, wait_idle
from tests.lora.conftest import MAX_TOKENS, prompt_ids

SERVED = ("sql", "chat", "math")  # "code" is loaded at run time


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_lora):
    modules = [f"{name}={tiny_lora.adapters[name]}" for name in SERVED]
    args = ["--model", tiny_lora.base, "--dtype", "float32", "--kv-cache-memory", "16MiB", "--num-threads", "1"]
    args += ["--enable-lora", "--lora-modules", *modules, "--max-loras", "3", "--allow-runtime-lora"]
    with running_stack(tmp_path_factory.mktemp("lora") / "serve.log", args) as s:
        yield s


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.addr) as channel:
        yield generate_pb2_grpc.TextGenerationStub(channel)


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=f"http://127.0.0.1:{stack.ports['--http-port']}", timeout=60) as client:
        yield client


def generate(stub, prompt: list[int], lora_name: str = "", max_tokens: int = MAX_TOKENS) -> list[int]:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = generate_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling, lora_name=lora_name)
    return collect(stub.Generate(request, timeout=120))[1]


def test_each_adapter_and_the_base_alone_equal_peft(stub, tiny_lora):
    outputs = {}
    for name in (None, *SERVED):
        outputs[name] = generate(stub, prompt_ids(1), name or "")
        assert outputs[name] == tiny_lora.greedy(name, prompt_ids(1)), name
    assert len({tuple(o) for o in outputs.values()}) == 4  # the adapters change the output


def test_sixteen_concurrent_requests_mixed_over_adapters_equal_peft(stub, tiny_lora):
    cases = [((None, *SERVED)[i % 4], prompt_ids(100 + i, 5 + i)) for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(generate, stub, prompt, name or "") for name, prompt in cases]
        got = [f.result() for f in futures]
    assert got == [tiny_lora.greedy(name, prompt) for name, prompt in cases]


def test_adapters_never_share_prefix_blocks(stack, stub):
    prompt = prompt_ids(7, 40)  # two full blocks of 16
    with grpc.insecure_channel(stack.scheduler_addr) as channel:
        wait_idle(channel)
        hits = []
        for name in ("sql", "chat", "", "sql"):
            generate(stub, prompt, name, max_tokens=2)
            hits.append(wait_idle(channel).prefix_cache_hits)
        assert get_stats(channel).prefix_cache_hits == hits[-1]
    before = hits[0]
    assert [h - before for h in hits] == [0, 0, 0, 32]  # only sql's second run finds sql's blocks


def test_openai_model_names_an_adapter(http, tiny_lora):
    models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    base = tiny_lora.base.rstrip("/").split("/")[-1]
    assert set(models) == {base, *SERVED}
    assert models["sql"]["parent"] == base and models[base]["parent"] is None
    body = {"model": "math", "prompt": prompt_ids(2), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    body["logprobs"] = 0
    answer = http.post("/v1/completions", json=body).json()
    assert answer["model"] == "math"
    tokens = [int(t.removeprefix("t")) for t in answer["choices"][0]["logprobs"]["tokens"]]  # "t5" is id 5
    assert tokens == tiny_lora.greedy("math", prompt_ids(2))
    missing = http.post("/v1/completions", json={**body, "model": "nope"})
    assert missing.status_code == 404 and "nope" in missing.json()["error"]["message"]


def test_unknown_adapter_is_not_found_on_grpc(stub):
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, prompt_ids(3), "nope")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in info.value.details()


def test_runtime_load_and_unload(http, stub, tiny_lora):
    load = {"lora_name": "code", "lora_path": tiny_lora.adapters["code"]}
    assert http.post("/v1/load_lora_adapter", json=load).status_code == 200
    assert generate(stub, prompt_ids(4), "code") == tiny_lora.greedy("code", prompt_ids(4))
    assert "code" in {m["id"] for m in http.get("/v1/models").json()["data"]}
    again = http.post("/v1/load_lora_adapter", json=load)
    assert again.status_code == 400 and "already in use" in again.json()["error"]["message"]
    bad = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nowhere"})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "code"}).status_code == 200
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, prompt_ids(4), "code")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "code"}).status_code == 404


def test_scheduler_metrics_count_requests_per_adapter(stack, http):
    text = httpx.get(f"http://127.0.0.1:{stack.ports['--scheduler-metrics-port']}/metrics", timeout=10).text
    info = [line for line in text.splitlines() if line.startswith("kvgrid_lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="3"' in info[0]
    assert any(line.startswith("kvgrid_lora_requests{") and 'lora_name="sql"' in line for line in text.splitlines())
