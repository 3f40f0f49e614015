"""Group choice without a network: the policy, what a frontend knows of a group, and address discovery."""

from __future__ import annotations

import socket
from collections import Counter

from kvgrid.v1 import scheduler_pb2
from services.common.config import NetworkConfig, RoutingConfig
from services.tokenizer import discovery
from services.tokenizer.group_view import ROUTED_TTL_S, GroupView
from services.tokenizer.router import Candidate, choose

CONFIG = RoutingConfig()


def pick(candidates, num_blocks=10, key=7, config=CONFIG) -> str:
    return choose(candidates, num_blocks, key, config).addr


def test_the_group_holding_most_of_the_prompt_wins_over_a_somewhat_busier_one():
    assert pick([Candidate("a", 3, 0.1, 9), Candidate("b", 0, 0.0, 0)]) == "a"
    # Holding little of the prompt is not worth the queue.
    assert pick([Candidate("a", 3, 0.1, 2), Candidate("b", 0, 0.0, 0)]) == "b"


def test_with_no_prefix_anywhere_the_least_loaded_group_wins():
    assert pick([Candidate("a", 1, 0.0, 0), Candidate("b", 0, 0.0, 0), Candidate("c", 2, 0.0, 0)]) == "b"
    assert pick([Candidate("a", 0, 0.6, 0), Candidate("b", 0, 0.1, 0)]) == "b"  # KV usage counts too


def test_badly_imbalanced_loads_let_load_alone_decide():
    busy = CONFIG.routing_balance_abs_threshold + 1
    assert pick([Candidate("a", busy, 0.0, 10), Candidate("b", 0, 0.0, 0)]) == "b"
    # Not imbalanced relative to the load (both busy): the cache still wins.
    assert pick([Candidate("a", busy + 5, 0.0, 10), Candidate("b", busy, 0.0, 0)]) == "a"


def test_ties_break_the_same_way_everywhere_and_spread_over_the_groups():
    groups = [Candidate(f"10.0.0.{i}:50052", 0, 0.0, 0) for i in range(3)]
    choices = [pick(groups, key=key) for key in range(3000)]
    assert choices == [pick(list(reversed(groups)), key=key) for key in range(3000)]  # order does not matter
    counts = Counter(choices)
    assert len(counts) == 3 and min(counts.values()) > 850, counts


def _message(stored=(), removed=(), cleared=False, running=None) -> scheduler_pb2.SchedulerMessage:
    message = scheduler_pb2.SchedulerMessage()
    message.kv_events.stored.extend(stored)
    message.kv_events.removed.extend(removed)
    message.kv_events.cleared = cleared
    message.kv_events.block_size = 4
    if running is not None:
        message.load.num_running = running
    return message


def test_a_group_view_matches_only_the_leading_blocks_it_holds():
    view = GroupView()
    view.apply(_message(stored=[1, 2, 3, -5], running=2))
    assert view.block_size == 4 and view.reported_load == 2
    assert view.matched_blocks([1, 2, 3, 4]) == 3
    assert view.matched_blocks([9, 2, 3]) == 0  # a hit in the middle is no prefix hit
    view.apply(_message(removed=[2]))
    assert view.matched_blocks([1, 2, 3]) == 1
    view.apply(_message(stored=[7], cleared=True))
    assert view.cached == {7} and view.reported_load == 2  # no load in the message: the last one stands


def test_routed_blocks_count_as_held_until_confirmed_or_expired():
    view = GroupView()
    view.note_routed([1, 2], now=100.0)
    assert view.matched_blocks([1, 2, 3], now=101.0) == 2
    assert view.matched_blocks([1, 2, 3], now=100.0 + ROUTED_TTL_S + 1) == 0
    view.apply(_message(removed=[2]))  # the scheduler evicted it: no longer counted
    assert view.matched_blocks([1, 2], now=101.0) == 1


def test_discovery_keeps_literals_and_single_names_and_expands_names_with_many_addresses(monkeypatch):
    assert discovery.resolve_all(["127.0.0.1:1", "[::1]:2", "localhost:3"]) == ["127.0.0.1:1", "[::1]:2", "localhost:3"]
    assert discovery.resolve("no-such-host.invalid:4") == ["no-such-host.invalid:4"]

    def fake(host, port, type=0):
        return [(socket.AF_INET, type, 6, "", (ip, int(port))) for ip in ("10.0.0.2", "10.0.0.1", "10.0.0.2")]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    assert discovery.resolve("kvgrid-scheduler:50052") == ["10.0.0.1:50052", "10.0.0.2:50052"]


def test_scheduler_addrs_fall_back_to_the_single_scheduler_addr():
    assert NetworkConfig(scheduler_addr="h:1").scheduler_addr_list() == ["h:1"]
    assert NetworkConfig(scheduler_addrs="a:1, b:2,a:1").scheduler_addr_list() == ["a:1", "b:2"]
    assert NetworkConfig(scheduler_addrs="a:1,nohost").validate() == [
        "--scheduler-addrs entries must be HOST:PORT, got 'nohost'"
    ]


def test_the_router_follows_dns_and_routes_only_to_groups_that_are_up(monkeypatch):
    import asyncio

    from services.tokenizer import router as router_module
    from services.tokenizer.model_state import ModelState

    answers = [["127.0.0.1:1", "127.0.0.2:1"], ["127.0.0.2:1", "127.0.0.3:1"]]
    monkeypatch.setattr(router_module, "resolve_named", lambda spec: dict.fromkeys(answers[0], "schedulers"))

    async def body():
        router = router_module.Router(
            ["schedulers:1"], ModelState("schedulers:1"), RoutingConfig(scheduler_resolve_interval=0.05)
        )
        await router.start()
        try:
            assert list(router.groups) == ["127.0.0.1:1", "127.0.0.2:1"]
            up = router.groups["127.0.0.2:1"]
            up.state.set_scheduler_serving(True)
            up.client._connected.set()
            assert router._state.scheduler_serving  # the frontend serves while any group does
            assert {router.pick([i] * 40).addr for i in range(20)} == {"127.0.0.2:1"}
            # A group that drops out of DNS keeps its requests in flight until they are done.
            busy = router.groups["127.0.0.1:1"].client
            busy._fail_all = lambda reason: None  # nothing listens there: keep the pretended request
            busy._handles["busy"] = None
            answers.pop(0)
            await asyncio.sleep(0.3)
            assert sorted(router.groups) == ["127.0.0.2:1", "127.0.0.3:1"]
            assert list(router._retired) == ["127.0.0.1:1"]
            busy._handles.clear()
            await asyncio.sleep(0.3)
            assert not router._retired
        finally:
            await router.close()

    asyncio.run(body())
