"""LoRA in the pure scheduler: at most max_loras adapters run at once, no request starves, adapters never share
prefix-cache blocks while requests of one adapter do, and admission refuses adapters when LoRA is off."""

from __future__ import annotations

import dataclasses

import pytest

from kvgrid.v1 import common_pb2, scheduler_pb2
from services.common.block_hash import cache_salt, prompt_block_hashes
from services.common.errors import InvalidArgument
from services.scheduler.admission import AdmissionLimits, admit
from tests.scheduler.core import Driver, make_request, make_scheduler

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # two full blocks of 4


def lora_request(request_id: str, adapter: str, prompt=PROMPT, max_tokens: int = 4):
    r = make_request(request_id, prompt, max_tokens=max_tokens)
    if adapter:
        r.lora = common_pb2.LoraRequest(name=adapter, path=f"/adapters/{adapter}")
        r.lora_name, r.cache_salt = adapter, cache_salt(adapter)
    return r


def lora_scheduler(max_loras: int, **kw):
    s = make_scheduler(num_blocks=64, block_size=4, **kw)
    s.limits = dataclasses.replace(s.limits, max_loras=max_loras)
    return s


def test_at_most_max_loras_adapters_run_and_none_starves():
    s = lora_scheduler(max_loras=2)
    d = Driver(s)
    for i, adapter in enumerate(["a", "b", "c", "a", "", "d", "b"]):
        s.add_request(lora_request(f"r{i}", adapter, max_tokens=3 + i))
    seen_adapters, admitted = [], []
    while s.has_work():
        out, _ = d.step()
        admitted += [n.request.request_id for n in out.new_requests]
        running = s.running_adapters()
        assert len(running) <= 2
        step = {p.request.lora_name for p in out.new_requests} | {p.request.lora_name for p in out.running}
        assert len(step - {""}) <= 2
        seen_adapters.append(running)
    assert sorted(d.outputs) == [f"r{i}" for i in range(7)]  # every request finished
    assert admitted[:2] == ["r0", "r1"]  # c waits at the head (FCFS): later requests do not pass it
    assert admitted.index("r2") < admitted.index("r3")
    assert {"a", "b"} in seen_adapters and any("c" in a for a in seen_adapters)


def test_adapters_never_share_blocks_and_one_adapter_does():
    s = lora_scheduler(max_loras=4)
    d = Driver(s)
    s.add_request(lora_request("a1", "a"))
    d.run()
    for rid, adapter in [("b1", "b"), ("base", ""), ("a2", "a")]:
        s.add_request(lora_request(rid, adapter))
        out, _ = d.step()
        d.run()
        hit = out.new_requests[0].num_computed_tokens
        assert hit == (8 if adapter == "a" else 0), rid


def test_router_hashes_agree_with_the_scheduler_per_adapter():
    s = lora_scheduler(max_loras=1)
    d = Driver(s)
    s.add_request(lora_request("a1", "a"))
    d.run()
    cached = set(s.kv.pool.cached_hashes())
    assert set(prompt_block_hashes(PROMPT, 4, cache_salt("a"))) <= cached
    assert not set(prompt_block_hashes(PROMPT, 4)) & cached
    assert cache_salt("") is None and cache_salt("a") != cache_salt("b")


def test_admission_needs_lora_enabled():
    limits = AdmissionLimits(max_model_len=64, num_blocks=16, block_size=4, vocab_size=100, max_waiting_requests=8)
    msg = scheduler_pb2.SubmitRequest(
        request_id="x", prompt_token_ids=[1, 2], lora=common_pb2.LoraRequest(name="a", path="/a")
    )
    with pytest.raises(InvalidArgument, match="no LoRA adapters"):
        admit(msg, limits, (), 0)
    request = admit(msg, dataclasses.replace(limits, lora=True), (), 0)
    assert (request.lora_name, request.lora.path, request.cache_salt) == ("a", "/a", cache_salt("a"))


def test_tier_keys_differ_per_adapter_and_match_within_one():
    from services.common import kv_keys
    from services.scheduler.kv_tiers import KvTiers

    tiers = KvTiers(4, 100, kv_keys.namespace("m", "float32", 4, 100), None, None)
    keys = {rid: tiers.keys(lora_request(rid, adapter), 2) for rid, adapter in [("a1", "a"), ("a2", "a"), ("b", "b")]}
    base = tiers.keys(lora_request("base", ""), 2)
    assert len(keys["a1"]) == 2 and keys["a1"] == keys["a2"]
    assert not set(keys["a1"]) & set(keys["b"]) and not set(keys["a1"]) & set(base)
