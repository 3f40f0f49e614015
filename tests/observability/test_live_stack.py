"""Observability of the real stack: metrics values, one trace per request, health, reflection, log lines.

One stack (real worker with the default model in float32, scheduler, two
frontends, each its own process) serves the whole module; tests run in file
order: the last two kill and restart the worker, then stop the scheduler. Checks compare values
with what the clients saw, as deltas between scrapes.
"""

from __future__ import annotations

import json
import re
import secrets
import threading

import grpc
import pytest

from kvgrid.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.e2e.stack import child_env
from tests.observability.otlp_collector import OtlpCollector
from tests.observability.probes import Samples, grpc_health, scrape, wait_for
from tests.observability.processes import ObservedStack
from tests.observability.reflection_client import describe_method, list_services
from tests.observability.traffic import Seen, generate, generate_concurrently, model_info

pytestmark = pytest.mark.timeout(600)  # the first test also waits for the model to load on a busy machine

SETTLE_S = 60.0


@pytest.fixture(scope="module")
def collector():
    with OtlpCollector() as c:
        yield c


@pytest.fixture(scope="module")
def stack(tmp_path_factory, collector):
    s = ObservedStack(tmp_path_factory.mktemp("observability"), {**child_env(), **collector.env()})
    try:
        yield s.start()
    finally:
        s.stop()


def scheduler_call(stack: ObservedStack, method: str, request):
    with grpc.insecure_channel(stack.scheduler_addr) as channel:
        return getattr(scheduler_pb2_grpc.SchedulerStub(channel), method)(request, timeout=30)


def stats(stack: ObservedStack) -> scheduler_pb2.SchedulerStats:
    return scheduler_call(stack, "GetStats", scheduler_pb2.GetStatsRequest())


def scrape_all(stack: ObservedStack) -> dict[str, Samples]:
    p = stack.ports
    return {
        "tokenizer": scrape(stack.text.http_port),
        "scheduler": scrape(p["scheduler_metrics"]),
        "worker": scrape(p["worker_metrics"]),
    }


def wait_settled(stack: ObservedStack, num_finished: float) -> dict[str, Samples]:
    """Scrapes once the text frontend counted ``num_finished`` requests in all and the scheduler holds nothing."""

    def settled():
        m = scrape_all(stack)
        done = m["tokenizer"].get("kvgrid_requests_total") == num_finished
        idle = m["scheduler"].get("kvgrid_num_requests_running") == 0 and stats(stack).num_blocks_used == 0
        return m if done and idle else None

    return wait_for(settled, SETTLE_S, "the frontend to count every request and the scheduler to go idle")


def unique_prompt(words: int) -> str:
    """A prompt no earlier request shares a prefix block with."""
    return f"{secrets.token_hex(4)} " + " ".join(f"word{i}" for i in range(words))


def test_health_is_serving_only_after_the_workers_handshake(stack):
    assert stack.startup["scheduler"] == "NOT_SERVING"  # up, but no worker yet
    for name in ("tokenizer-text", "tokenizer-json"):
        assert stack.startup[name] == "NOT_SERVING"
        assert stack.startup[f"{name} /health"] == 503
    assert stack.startup["worker"] == "NOT_SERVING"  # answering while it loads the model
    for addr in (stack.worker_addr, stack.scheduler_addr, stack.text.addr, stack.json.addr):
        assert grpc_health(addr) == "SERVING"
    assert grpc_health(stack.scheduler_addr, "kvgrid.v1.Scheduler") == "SERVING"


def test_metrics_count_what_the_clients_saw(stack):
    handshake = scheduler_call(stack, "GetWorkerInfo", scheduler_pb2.GetWorkerInfoRequest())
    before, stats_before = scrape_all(stack), stats(stack)
    prompts = {f"m-{i}": unique_prompt(3 + 4 * i) for i in range(4)}
    seen = generate_concurrently(stack.text.addr, prompts, max_tokens=6)
    after = wait_settled(stack, before["tokenizer"].get("kvgrid_requests_total") + len(prompts))
    stats_after = stats(stack)

    def delta(service: str, name: str, **labels) -> float:
        return after[service].get(name, **labels) - before[service].get(name, **labels)

    n = len(seen)
    assert all(s.finish_reason == "length" and len(s.token_ids) == 6 == s.completion_tokens for s in seen)
    num_prompt, num_output = sum(s.prompt_tokens for s in seen), sum(len(s.token_ids) for s in seen)
    t = "tokenizer"
    assert delta(t, "kvgrid_requests_total", status="length") == n
    assert delta(t, "kvgrid_prompt_tokens_total") == num_prompt
    assert delta(t, "kvgrid_generation_tokens_total") == num_output
    assert delta(t, "kvgrid_time_to_first_token_seconds_count") == n
    assert delta(t, "kvgrid_inter_token_latency_seconds_count") == num_output - sum(s.num_first_tokens for s in seen)
    assert delta(t, "kvgrid_e2e_request_latency_seconds_count") == n
    assert 0 < delta(t, "kvgrid_time_to_first_token_seconds_sum") < delta(t, "kvgrid_e2e_request_latency_seconds_sum")

    s = "scheduler"
    assert delta(s, "kvgrid_num_preemptions_total") == 0  # 4 short requests fit the cache
    num_hits = delta(s, "kvgrid_prefix_cache_hits_total")
    assert delta(s, "kvgrid_prefix_cache_queries_total") == num_prompt
    assert num_hits == stats_after.prefix_cache_hits - stats_before.prefix_cache_hits
    assert delta(s, "kvgrid_request_queue_seconds_count") == n
    # Every prompt token (less prefix hits) and every output token but the last of each request is computed once.
    assert delta(s, "kvgrid_step_batch_tokens_sum") == num_prompt - num_hits + num_output - n
    assert after[s].get("kvgrid_num_requests_running") == 0 == after[s].get("kvgrid_num_requests_waiting")
    assert after[s].get("kvgrid_kv_cache_usage_ratio") == 0
    assert after[s].get("kvgrid_kv_blocks_total") == handshake.num_blocks

    w = "worker"
    num_steps = stats_after.num_steps  # since the scheduler started; the worker was never restarted so far
    assert after[w].get("kvgrid_worker_step_seconds_count") == num_steps
    assert after[s].get("kvgrid_schedule_seconds_count") == num_steps
    assert delta(w, "kvgrid_worker_step_seconds_count") == stats_after.num_steps - stats_before.num_steps > 0
    assert after[w].get("kvgrid_worker_num_blocks") == handshake.num_blocks
    assert after[w].get("kvgrid_worker_profiled_memory_bytes", kind="kv_cache") == handshake.memory.kv_cache_bytes
    assert after[w].get("kvgrid_worker_profiled_memory_bytes", kind="weights") == handshake.memory.weights_bytes > 0
    assert after[w].get("kvgrid_worker_model_load_seconds") == pytest.approx(handshake.load_seconds, rel=1e-3)

    model = model_info(stack.text.addr).model
    for samples in after.values():
        assert samples.label_values("model") == {model}


def test_kv_cache_usage_rises_while_requests_run_and_a_tiny_cache_preempts(stack, collector):
    before, stats_before = scrape_all(stack), stats(stack)
    observed: list[tuple[float, float]] = []  # (kv usage, running) from scrapes taken while the requests ran
    running = threading.Event()
    running.set()

    def watch():
        while running.is_set():
            m = scrape(stack.ports["scheduler_metrics"])
            observed.append((m.get("kvgrid_kv_cache_usage_ratio"), m.get("kvgrid_num_requests_running")))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        # 4 x (~20 prompt + 100 output) tokens need 32 blocks of 16 tokens; the pool has 24.
        prompts = {f"p-{i}": unique_prompt(12) for i in range(4)}
        seen = generate_concurrently(stack.text.addr, prompts, max_tokens=100)
    finally:
        running.clear()
        watcher.join()
    after = wait_settled(stack, before["tokenizer"].get("kvgrid_requests_total") + len(prompts))

    assert all(s.finish_reason == "length" and len(s.token_ids) == 100 for s in seen)
    assert max(usage for usage, _ in observed) > 0 and all(0 <= usage <= 1 for usage, _ in observed)
    assert max(num for _, num in observed) > 0
    num_preempted = after["scheduler"].get("kvgrid_num_preemptions_total") - before["scheduler"].get(
        "kvgrid_num_preemptions_total"
    )
    assert num_preempted > 0
    assert num_preempted == stats(stack).num_preemptions - stats_before.num_preemptions
    assert after["scheduler"].get("kvgrid_kv_cache_usage_ratio") == 0
    assert after["scheduler"].get("kvgrid_num_requests_running") == 0
    # preempted requests still count one TTFT each: the client saw one first token per request
    ttft = "kvgrid_time_to_first_token_seconds_count"
    assert after["tokenizer"].get(ttft) - before["tokenizer"].get(ttft) == len(prompts)

    # In the traces, each request's scheduler span counts its preemptions, and the worker held the request once
    # more per preemption: a new worker span each time it was admitted again, all in the request's one trace.
    def traced():
        found = {
            rid: (spans_named(collector, rid, "scheduler.submit"), spans_named(collector, rid, "worker.request"))
            for rid in prompts
        }
        complete = all(
            len(submit) == 1 and len(held) >= submit[0].attributes["kvgrid.num_preemptions"] + 1
            for submit, held in found.values()
        )
        return found if complete else None

    found = wait_for(traced, 30, "the spans of every request")
    for (submit,), held in found.values():
        assert len(held) == submit.attributes["kvgrid.num_preemptions"] + 1
        assert {span.trace_id for span in held} == {submit.trace_id}
    assert sum(submit.attributes["kvgrid.num_preemptions"] for (submit,), _ in found.values()) == num_preempted


def test_prefix_cache_hits_rise_for_a_repeated_prompt(stack):
    prompt = unique_prompt(30)
    hits = "kvgrid_prefix_cache_hits_total"
    h0 = scrape(stack.ports["scheduler_metrics"]).get(hits)
    first = generate(stack.text.addr, prompt, 1, "prefix-1")
    h1 = scrape(stack.ports["scheduler_metrics"]).get(hits)
    second = generate(stack.text.addr, prompt, 1, "prefix-2")
    h2 = scrape(stack.ports["scheduler_metrics"]).get(hits)
    block_size = model_info(stack.text.addr).block_size
    assert first.prompt_tokens > 2 * block_size
    # every full block but the one holding the last prompt token (its logits are needed) comes from the cache
    expected = (first.prompt_tokens - 1) // block_size * block_size
    assert (h1 - h0, first.cached_prompt_tokens) == (0, 0)
    assert h2 - h1 == expected == second.cached_prompt_tokens
    assert first.token_ids == second.token_ids


def spans_named(collector: OtlpCollector, request_id: str, name: str) -> list:
    return [s for s in collector.spans() if s.name == name and s.attributes.get("kvgrid.request_id") == request_id]


def spans_of(collector: OtlpCollector, request_id: str, num: int = 3):
    def found():
        spans = [s for s in collector.spans() if s.attributes.get("kvgrid.request_id") == request_id]
        return {s.service: s for s in spans} if len({s.service for s in spans}) >= num else None

    return wait_for(found, 30, f"spans of {request_id} from {num} services")


def test_one_trace_per_request_across_the_three_services(stack, collector):
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    metadata = [("traceparent", f"00-{trace_id}-{client_span}-01")]
    seen = generate(stack.text.addr, unique_prompt(5), 3, "traced-by-client", metadata=metadata)
    generate(stack.text.addr, unique_prompt(5), 3, "traced-here")

    spans = spans_of(collector, "traced-by-client")
    assert set(spans) == {"kvgrid-tokenizer", "kvgrid-scheduler", "kvgrid-worker"}
    assert {s.trace_id for s in spans.values()} == {trace_id}
    tokenizer, scheduler, worker = spans["kvgrid-tokenizer"], spans["kvgrid-scheduler"], spans["kvgrid-worker"]
    assert tokenizer.parent_span_id == client_span
    assert scheduler.parent_span_id == tokenizer.span_id
    assert worker.parent_span_id == scheduler.span_id
    assert tokenizer.attributes["kvgrid.finish_reason"] == "length"
    # the worker's span shows its steps: the whole prompt in one, then one per further token
    assert worker.attributes["kvgrid.num_steps"] == 3
    assert worker.events == (("prefill", {"kvgrid.num_tokens": seen.prompt_tokens, "kvgrid.start": 0}),)

    spans = spans_of(collector, "traced-here")  # no caller context: the frontend starts the trace
    assert len({s.trace_id for s in spans.values()}) == 1
    assert spans["kvgrid-tokenizer"].parent_span_id == ""
    assert spans["kvgrid-worker"].parent_span_id == spans["kvgrid-scheduler"].span_id


def test_reflection_lists_every_service_without_proto_files(stack):
    common = {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    assert set(list_services(stack.text.addr)) == common | {"kvgrid.v1.TextGeneration"}
    assert set(list_services(stack.scheduler_addr)) == common | {"kvgrid.v1.Scheduler"}
    assert set(list_services(stack.worker_addr)) == common | {"kvgrid.v1.Worker"}
    assert {"Generate", "Chat", "GetModelInfo"} <= set(describe_method(stack.text.addr, "kvgrid.v1.TextGeneration"))
    assert {"Submit", "Abort"} <= set(describe_method(stack.scheduler_addr, "kvgrid.v1.Scheduler"))
    assert {"Handshake", "Execute"} <= set(describe_method(stack.worker_addr, "kvgrid.v1.Worker"))


TEXT_DONE = re.compile(
    r"request (\S+) done: (\w+), prompt (\d+) tokens, output (\d+) tokens, ttft (-|[\d.]+s), total ([\d.]+)s$"
)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_one_completion_line_per_request_in_text_and_json(stack, collector):
    text_seen = [generate(stack.text.addr, unique_prompt(4), 4, f"log-text-{i}") for i in range(2)]
    json_seen = [generate(stack.json.addr, unique_prompt(4), 4, f"log-json-{i}") for i in range(2)]
    wait_for(lambda: "log-json-1 done" in stack.json.proc.log(), 30, "the JSON completion line")
    wait_for(lambda: "log-text-1 done" in stack.text.proc.log(), 30, "the text completion line")

    lines = [m for m in map(TEXT_DONE.search, stack.text.proc.log().splitlines()) if m]
    by_id = {m[1]: m for m in lines}
    # exactly one line per request this frontend finished, whatever its status
    assert len(lines) == len(by_id) == scrape(stack.text.http_port).get("kvgrid_requests_total")
    for s in text_seen:
        m = by_id[s.request_id]
        assert (m[2], int(m[3]), int(m[4])) == ("length", s.prompt_tokens, len(s.token_ids))
        assert 0 < float(m[5].removesuffix("s")) <= float(m[6])

    # every line of a JSON-logging process is one JSON object
    records = json_lines(stack.json.proc.log())
    assert all({"ts", "level", "msg", "logger"} <= set(r) and r["service"] == "tokenizer" for r in records)
    for proc in (stack.scheduler, stack.worker):  # the worker's weight loading shows no progress bar here
        assert all({"ts", "level", "msg"} <= set(r) and r["service"] == proc.name for r in json_lines(proc.log()))
    done = {r["request_id"]: r for r in records if r.get("event") == "request_done"}
    assert len(done) == len([r for r in records if r.get("event") == "request_done"]) == 2
    for s in json_seen:
        r = done[s.request_id]
        assert (r["finish_reason"], r["prompt_tokens"], r["output_tokens"]) == ("length", s.prompt_tokens, 4)
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        # the line names the request's trace, as the frontend's span does
        assert r["trace_id"] == spans_of(collector, s.request_id)["kvgrid-tokenizer"].trace_id


def test_a_draining_frontend_is_not_serving_while_its_streams_finish(stack):
    frontend = stack.json
    seen = Seen("draining")
    stream = threading.Thread(target=generate, args=(frontend.addr, unique_prompt(4), 32, "draining", (), seen))
    stream.start()
    try:
        assert seen.first_token.wait(60)
        frontend.proc.process.terminate()
        wait_for(lambda: frontend.http_health() == 503, 10, "/health to turn 503")
        still_streaming = stream.is_alive()
    finally:
        stream.join(120)
    assert still_streaming, "the stream ended before the health change could be seen"
    assert (seen.finish_reason, len(seen.token_ids)) == ("length", 32)
    assert frontend.proc.process.wait(30) == 0
    (record,) = [r for r in json_lines(frontend.proc.log()) if r.get("request_id") == "draining" and "event" in r]
    assert record["finish_reason"] == "length"


def test_health_follows_a_killed_and_restarted_worker(stack):
    frontend = stack.text
    stack.worker.kill()
    wait_for(lambda: grpc_health(stack.scheduler_addr) == "NOT_SERVING", 60, "the scheduler to notice")
    wait_for(lambda: frontend.http_health() == 503, 60, "the frontend's /health to follow")
    assert grpc_health(frontend.addr) == "NOT_SERVING"
    unavailable = scrape(frontend.http_port).get("kvgrid_requests_total", status="unavailable")
    with pytest.raises(grpc.RpcError) as refused:
        generate(frontend.addr, "hello", 2, "no-worker")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    # a refused request is counted and logged with its status too
    wait_for(lambda: "request no-worker done: unavailable" in frontend.proc.log(), 30, "the refusal's log line")
    assert scrape(frontend.http_port).get("kvgrid_requests_total", status="unavailable") == unavailable + 1

    stack.worker.start()
    wait_for(lambda: grpc_health(stack.scheduler_addr) == "SERVING", 420, "the scheduler to serve again", 0.5)
    wait_for(lambda: frontend.http_health() == 200, 60, "the frontend's /health to follow")
    assert grpc_health(frontend.addr) == "SERVING"
    assert generate(frontend.addr, unique_prompt(3), 2, "after-restart").finish_reason == "length"
    handshake = scheduler_call(stack, "GetWorkerInfo", scheduler_pb2.GetWorkerInfoRequest())
    assert scrape(stack.ports["worker_metrics"]).get("kvgrid_worker_num_blocks") == handshake.num_blocks


def test_frontends_stop_serving_when_the_scheduler_stops(stack):
    frontend = stack.text
    assert frontend.http_health() == 200
    assert stack.scheduler.terminate() == 0
    wait_for(lambda: frontend.http_health() == 503, 60, "the frontend's /health to follow the scheduler")
    assert grpc_health(frontend.addr) == "NOT_SERVING"
    frontend.proc.check_alive()  # it waits for a scheduler to come back
