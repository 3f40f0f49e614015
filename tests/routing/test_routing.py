"""Routing over real worker groups: two scheduler+worker pairs behind two frontends (tiny random Llama, CPU).

Which group ran a request is read from the groups' own prefix-cache counters (GetStats).
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.routing.groups import Frontend, Group, generate
from tests.worker.tiny import save_tiny_model, save_tiny_tokenizer

pytestmark = pytest.mark.timeout(300)

PREFIX_LEN = 64  # four full blocks of 16


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    model = str(tmp_path_factory.mktemp("tiny-routing"))
    save_tiny_model(model)
    save_tiny_tokenizer(model)
    logs = tmp_path_factory.mktemp("routing-logs")
    # One plan per step: the long request of the killed-group test must stay in flight long enough to be seen
    # running, and plans of 8 steps run the tiny model's ~190 tokens in a fraction of a second.
    one_step = ["--num-scheduler-steps", "1"]
    groups = [Group(name, model, logs, ["--kv-cache-memory", "4MiB"], one_step).start() for name in ("g0", "g1")]
    frontends = []
    try:
        addrs = [g.addr for g in groups]
        frontends = [Frontend(addrs, logs / f"frontend{i}.log").start() for i in range(2)]
        for part in (*groups, *frontends):
            part.wait_serving()
        # Both frontends have both groups in rotation once each has run a request on each (streams open).
        _wait_for(lambda: all(_both_groups_up(f) for f in frontends), 60, "the frontends to see both groups")
        yield groups, frontends
    finally:
        for part in (*frontends, *groups):
            part.stop()


def _both_groups_up(frontend: Frontend) -> bool:
    text = frontend.log_path.read_text(errors="replace")
    return text.count("stream to the scheduler at") >= 2


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout}s for {what}")
        time.sleep(0.1)


def _queries(groups) -> list[int]:
    return [g.stats().prefix_cache_queries for g in groups]


def _served(groups, run) -> tuple[list[int], list[int]]:
    """(prompt tokens each group looked up, prompt tokens each found cached) while ``run()`` ran."""
    before = [g.stats() for g in groups]
    run()
    after = [g.stats() for g in groups]
    return (
        [a.prefix_cache_queries - b.prefix_cache_queries for a, b in zip(after, before, strict=True)],
        [a.prefix_cache_hits - b.prefix_cache_hits for a, b in zip(after, before, strict=True)],
    )


def _prefix(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 150) for _ in range(PREFIX_LEN)]


def test_requests_sharing_a_long_prefix_land_on_one_group_and_hit_its_cache(deployment):
    groups, (front, _) = deployment
    prefix = _prefix(1)
    homes = []
    for i in range(4):
        queries, hits = _served(groups, lambda i=i: generate(front.addr, [*prefix, 7, 8, 9, i + 10]))
        assert sorted(queries) == [0, PREFIX_LEN + 4], queries
        homes.append(queries.index(PREFIX_LEN + 4))
        if i:
            assert hits[homes[-1]] >= PREFIX_LEN, hits  # the shared prefix came from the cache
    assert len(set(homes)) == 1, homes


def test_unique_prompts_spread_evenly(deployment):
    groups, (front, _) = deployment
    prompts = [[*_prefix(100 + i), 3] for i in range(8)]

    def run():
        with ThreadPoolExecutor(len(prompts)) as pool:
            list(pool.map(lambda p: generate(front.addr, p, max_tokens=48), prompts))

    queries, _ = _served(groups, run)
    per_group = [q // (PREFIX_LEN + 1) for q in queries]
    assert sum(per_group) == 8 and min(per_group) >= 3, per_group


def test_two_frontends_route_the_same_prefix_to_the_same_group(deployment):
    groups, (a, b) = deployment
    for seed in (11, 12, 13):
        prefix = _prefix(seed)
        first, _ = _served(groups, lambda p=prefix: generate(a.addr, [*p, 1]))
        second, hits = _served(groups, lambda p=prefix: generate(b.addr, [*p, 2]))
        home = first.index(max(first))
        assert second[home] > 0 and second[1 - home] == 0, (first, second)
        assert hits[home] >= PREFIX_LEN


def test_a_killed_group_fails_its_requests_is_avoided_at_once_and_rejoins_after_a_restart(deployment):
    groups, (front, _) = deployment
    prefix = _prefix(21)
    queries, _ = _served(groups, lambda: generate(front.addr, [*prefix, 1]))
    victim = queries.index(max(queries))
    other = groups[1 - victim]

    # A long request on the victim (its prefix is cached there), in flight when the group dies.
    with ThreadPoolExecutor(1) as pool:
        doomed = pool.submit(generate, front.addr, [*prefix, 2], 200)
        _wait_for(lambda: groups[victim].stats().num_running == 1, 30, "the long request to run")
        groups[victim].kill()
        with pytest.raises(grpc.RpcError) as failed:
            doomed.result(timeout=30)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    killed_at = time.monotonic()

    time.sleep(max(0.0, 1.0 - (time.monotonic() - killed_at)))
    before = other.stats().prefix_cache_queries
    for i in range(4):  # even the prefix the dead group held goes to the live one, and succeeds
        assert len(generate(front.addr, [*prefix, 3 + i])) == 4
    assert other.stats().prefix_cache_queries - before == 4 * (PREFIX_LEN + 1)

    groups[victim].start().wait_serving()
    prompts = [[*_prefix(200 + i), 3] for i in range(6)]

    def victim_serves() -> bool:
        with ThreadPoolExecutor(len(prompts)) as pool:
            list(pool.map(lambda p: generate(front.addr, p, max_tokens=24), prompts))
        return groups[victim].stats().prefix_cache_queries > 0

    _wait_for(victim_serves, 30, "the restarted group to get requests again")
