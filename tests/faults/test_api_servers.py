"""`kvgrid serve --api-server-count 2`: two frontend processes on the same public ports both serve requests, one
/metrics answer sums them, a frontend killed with SIGKILL is restarted while the other serves on, and SIGTERM drains
the streams of both."""

from __future__ import annotations

import glob
import http.client
import json
import os
import shutil
import signal
import threading
import time

import grpc
import pytest
from prometheus_client import CollectorRegistry, multiprocess
from prometheus_client.parser import text_string_to_metric_families

from kvgrid.cli.probes import listens
from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.stack import Stack, collect, pid_alive
from tests.faults.serve_stack import child_pid
from tests.procs import listeners
from tests.worker.tiny import save_tiny_model, save_tiny_tokenizer

pytestmark = pytest.mark.timeout(600)

FRONTENDS = ("tokenizer-1", "tokenizer-2")
NUM_REQUESTS = 24  # per API, each on its own connection: the chance that one frontend gets none is 2 * 2**-48
# A connection of its own per channel: grpc-python otherwise shares one among channels to the same address.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
DRAIN_TOKENS = 600


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model = str(tmp_path_factory.mktemp("tiny-model"))
    save_tiny_model(model, max_position_embeddings=1024)
    save_tiny_tokenizer(model, vocab_size=150)
    metrics_dir = tmp_path_factory.mktemp("frontend-metrics")
    args = ["--model", model, "--dtype", "float32", "--kv-cache-memory", "64MiB", "--num-threads", "1"]
    args += ["--api-server-count", "2", "--shutdown-grace", "120"]
    log = tmp_path_factory.mktemp("api-servers") / "serve.log"
    stack = Stack(log, args, env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)})
    stack.metrics_dir = str(metrics_dir)
    stack.model_name = os.path.basename(model)
    stack.start()
    try:
        yield stack.wait_ready()
    finally:
        stack.stop()


def request(i: int, max_tokens: int = 8) -> generate_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return generate_pb2.GenerateRequest(prompt=f"t{i % 100} t5 t7 t{i % 13}", sampling=sampling)


def generate(addr: str, i: int, max_tokens: int = 8) -> list[int]:
    with grpc.insecure_channel(addr, options=OWN_CONNECTION) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        _, ids, last = collect(stub.Generate(request(i, max_tokens), timeout=60))
    assert last.finish_reason == "length"
    return ids


def complete(port: int, model: str, i: int) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)  # a new connection each time
    try:
        body = {"model": model, "prompt": f"t{i % 100} t3", "max_tokens": 4, "ignore_eos": True}
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        reply = connection.getresponse()
        assert reply.status == 200, reply.read()
        return json.loads(reply.read())
    finally:
        connection.close()


def scrape(port: int) -> str:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("GET", "/metrics")
        return connection.getresponse().read().decode()
    finally:
        connection.close()


def requests_total(text: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "kvgrid_requests"
        for sample in family.samples
        if sample.name == "kvgrid_requests_total"
    )


def served_by(metrics_dir: str, pid: int, tmp_path) -> float:
    """Requests finished by process ``pid`` alone: its own files of the shared metrics directory, read as a
    directory of one."""
    own = tmp_path / f"pid-{pid}"
    own.mkdir(exist_ok=True)
    for path in glob.glob(os.path.join(metrics_dir, f"*_{pid}.db")):
        shutil.copy(path, own)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(own))
    return sum(
        sample.value
        for family in registry.collect()
        if family.name == "kvgrid_requests"
        for sample in family.samples
        if sample.name == "kvgrid_requests_total"
    )


def test_both_frontends_serve_on_the_same_ports_and_metrics_sum_them(stack, tmp_path):
    assert set(FRONTENDS) <= set(stack.child_pids)
    http_port = stack.ports["--http-port"]
    before = requests_total(scrape(http_port))
    for i in range(NUM_REQUESTS):
        assert len(generate(stack.addr, i)) == 8
        assert complete(http_port, stack.model_name, i)["choices"][0]["finish_reason"] == "length"
    per_process = {name: served_by(stack.metrics_dir, child_pid(stack, name), tmp_path) for name in FRONTENDS}
    assert all(count > 0 for count in per_process.values()), per_process
    # Whichever process answers the scrape, /metrics counts the requests of both.
    for _ in range(4):
        assert requests_total(scrape(http_port)) - before == 2 * NUM_REQUESTS


def test_a_killed_frontend_is_restarted_while_the_other_serves(stack, tmp_path):
    old = child_pid(stack, "tokenizer-1")
    os.kill(old, signal.SIGKILL)
    # A connection the kernel queued on the dying process's socket before it closed is reset (clients retry);
    # once that socket is closed, the other frontend takes every new connection. The kernel's socket table says
    # when: the dead process's fd list reads empty while its other threads still exit, holding the socket open.
    port = stack.ports["--tokenizer-port"]
    deadline = time.monotonic() + 30
    while listeners(port) > 1:
        assert time.monotonic() < deadline, listeners(port)
        time.sleep(0.05)
    for i in range(8):
        assert len(generate(stack.addr, i)) == 8
    deadline = time.monotonic() + 120
    while (new := child_pid(stack, "tokenizer-1")) == old or not listens(new, (stack.ports["--tokenizer-port"],)):
        assert time.monotonic() < deadline, stack.log()[-4000:]
        time.sleep(0.2)
    assert not pid_alive(old)
    assert "the tokenizer-1 was killed by signal SIGKILL; restarting it in 1s" in stack.log()
    # The restarted process joined the ports again: it gets its share of new connections.
    for i in range(NUM_REQUESTS):
        assert len(generate(stack.addr, i)) == 8
    assert served_by(stack.metrics_dir, new, tmp_path) > 0


def test_sigterm_drains_the_streams_of_every_frontend(stack):
    outcomes: list[list[int] | Exception] = [[] for _ in range(12)]  # both frontends get some

    def stream(i: int) -> None:
        try:
            with grpc.insecure_channel(stack.addr, options=OWN_CONNECTION) as channel:
                stub = generate_pb2_grpc.TextGenerationStub(channel)
                for reply in stub.Generate(request(i, DRAIN_TOKENS), timeout=300):
                    outcomes[i].extend(reply.token_ids)
                    if reply.finish_reason:
                        outcomes[i].append(-1)  # finished
        except grpc.RpcError as e:
            outcomes[i] = e

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(len(outcomes))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while not all(isinstance(o, list) and o for o in outcomes):
        assert time.monotonic() < deadline and not any(isinstance(o, Exception) for o in outcomes), outcomes
        time.sleep(0.05)
    assert not any(o[-1] == -1 for o in outcomes), "streams should be mid-way at SIGTERM"
    stack.process.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(timeout=300)
    for i, outcome in enumerate(outcomes):
        assert isinstance(outcome, list) and len(outcome) == DRAIN_TOKENS + 1 and outcome[-1] == -1, (i, outcome)
    assert stack.process.wait(timeout=180) == 0
    log = stack.log()
    stops = [log.find(f"kvgrid serve: stopping the {name} (pid") for name in (*FRONTENDS, "scheduler", "worker")]
    assert -1 not in stops and max(stops[:2]) < stops[2] < stops[3], stops
