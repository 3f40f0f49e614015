"""The frontend's LoRA side in-process, in front of a fake scheduler: the adapter (name and path) travels in the
Submit, runtime load/unload needs --allow-runtime-lora (404 without) and the API key when keys are set, and the
router prefers a group already running the request's adapter."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from kvgrid.v1 import worker_pb2
from services.common.config import (
    Config,
    HttpConfig,
    LimitsConfig,
    LoraConfig,
    ModelConfig,
    NetworkConfig,
    ObservabilityConfig,
    RoutingConfig,
    SchedulerConfig,
    SecurityConfig,
)
from services.tokenizer.group_view import GroupView
from services.tokenizer.model_state import ModelState
from services.tokenizer.router import Router
from services.tokenizer.text_tokenizer import read_tokenizer_dir
from tests.tokenizer.conftest import LoopThread, wait_until
from tests.tokenizer.fake_scheduler import Script, start_fake_scheduler
from tests.worker.tiny import save_tiny_tokenizer

pytestmark = pytest.mark.timeout(120)

KEY = "lora-test-key"


def _config(port: int, lora: LoraConfig, security: SecurityConfig) -> Config:
    return Config(
        model=ModelConfig(),
        scheduler=SchedulerConfig(),
        observability=ObservabilityConfig(),
        network=NetworkConfig(host="127.0.0.1", scheduler_addr=f"127.0.0.1:{port}"),
        security=security,
        limits=LimitsConfig(),
        http=HttpConfig(),
        lora=lora,
    )


@pytest.fixture(scope="module")
def frontends(tmp_path_factory, tiny_lora):
    from services.tokenizer.server import start_tokenizer

    files = read_tokenizer_dir(save_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab_size=158))
    info = worker_pb2.HandshakeResponse(
        model="tiny", block_size=16, num_blocks=64, max_model_len=256, vocab_size=160, eos_token_ids=[158], max_loras=2
    )
    info.tokenizer_files.update(files)
    loop = LoopThread()
    scheduler, fake, _, port = loop.run(start_fake_scheduler(info))
    fake.script = Script(deltas=[[70], [71]])
    lora = LoraConfig(enable_lora=True, lora_modules=f"sql={tiny_lora.adapters['sql']}", allow_runtime_lora=True)
    keyed = loop.run(start_tokenizer(_config(port, lora, SecurityConfig(api_key=KEY))))
    off = loop.run(start_tokenizer(_config(port, LoraConfig(), SecurityConfig())))
    for server in (keyed, off):
        wait_until(lambda s=server: s.state.serving, what="the frontend to serve")
    yield SimpleNamespace(keyed=keyed, off=off, fake=fake)
    for server in (keyed, off):
        loop.run(server.stop(0))
    loop.run(scheduler.stop(0))
    loop.close()


def client(server, key: str | None = None) -> httpx.Client:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", headers=headers, timeout=30)


def test_the_adapter_travels_in_the_submit(frontends, tiny_lora):
    with client(frontends.keyed, KEY) as http:
        body = {"model": "sql", "prompt": "t5 t6", "max_tokens": 2}
        answer = http.post("/v1/completions", json=body)
        assert answer.status_code == 200 and answer.json()["model"] == "sql"
    submit = frontends.fake.submits[-1]
    assert (submit.lora.name, submit.lora.path) == ("sql", tiny_lora.adapters["sql"])


def test_runtime_routes_need_the_key(frontends, tiny_lora):
    load = {"lora_name": "chat", "lora_path": tiny_lora.adapters["chat"]}
    with client(frontends.keyed) as http:
        assert http.post("/v1/load_lora_adapter", json=load).status_code == 401
    with client(frontends.keyed, KEY) as http:
        assert http.post("/v1/load_lora_adapter", json=load).status_code == 200
        assert http.post("/v1/completions", json={"model": "chat", "prompt": "t5", "max_tokens": 1}).status_code == 200
        assert frontends.fake.submits[-1].lora.name == "chat"
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 200


def test_without_the_flags_there_are_no_adapters_nor_runtime_routes(frontends, tiny_lora):
    with client(frontends.off) as http:
        load = {"lora_name": "chat", "lora_path": tiny_lora.adapters["chat"]}
        assert http.post("/v1/load_lora_adapter", json=load).status_code == 404
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 404
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny"]
        refused = http.post("/v1/completions", json={"model": "sql", "prompt": "t5", "max_tokens": 1})
        assert refused.status_code == 404


def test_the_router_prefers_a_group_running_the_adapter():
    router = Router(["a:1", "b:1"], ModelState("a:1, b:1"), RoutingConfig())
    views = {"a:1": GroupView(), "b:1": GroupView()}
    views["b:1"].lora_adapters = frozenset({"sql"})
    views["a:1"].num_running = 1  # a is idler by load alone: the adapter outweighs that
    views["b:1"].num_running = 2
    for addr, view in views.items():
        router.groups[addr] = SimpleNamespace(
            addr=addr, available=True, block_size=16, client=SimpleNamespace(view=view, num_in_flight=0)
        )
    prompt = list(range(40))
    assert router.pick(prompt, "sql").addr == "b:1"
    assert router.pick(prompt).addr == "a:1"
    assert router.pick(prompt, "chat").addr == "a:1"  # no group runs it: the usual choice
