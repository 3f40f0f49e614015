"""Async scheduling and plans of several steps through the real worker: a tiny random Llama gives the same
tokens with them on and off.

The scheduler (in-process, over gRPC) plans each step while the worker runs the
previous one, and the worker computes the token it sampled itself. Greedy and
seeded requests, a KV pool small enough to preempt, and EOS stops found one step
late must give exactly the tokens of sync scheduling; so must plans of several decode steps
(StepPlan.num_steps: 4, or as many as the auto rule takes from the worker's step times), with stops
found inside a plan.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from kvgrid.v1 import scheduler_pb2_grpc
from services.common import config as cfg
from services.common.server import insecure_channel
from services.scheduler.server import start
from services.worker.core import build_core
from services.worker.server import start_worker
from tests.scheduler.harness import submit_request
from tests.scheduler.test_connect import Frontend
from tests.worker.tiny import request, save_tiny_model, save_tiny_tokenizer

pytestmark = pytest.mark.timeout(300)

EOS = 150  # <|im_end|> of the tiny tokenizer


def _config(model_dir: str, async_scheduling: bool, worker_addr: str = "", steps: int = 1) -> cfg.Config:
    config = cfg.build_config(environ={})
    config.model.model = model_dir
    config.model.dtype = "float32"
    config.model.max_model_len = 64
    config.device.device = "cpu"
    config.device.attention_backend = "torch"
    config.cache.block_size = 4
    config.cache.kv_cache_memory = 48 * 1024  # 48 blocks of 1 KiB: far fewer than the requests want
    config.scheduler.max_num_seqs = 16
    config.scheduler.async_scheduling = async_scheduling
    config.scheduler.num_scheduler_steps = steps
    config.network.host = "127.0.0.1"
    config.network.scheduler_port = 0
    config.network.worker_addr = worker_addr
    return config


def _requests() -> list:
    rng = random.Random(5)
    requests = []
    for i in range(24):
        prompt = [rng.randrange(0, 150) for _ in range(rng.randint(3, 14))]
        sampling = dict(max_tokens=rng.randint(4, 24), ignore_eos=i % 4 == 0)
        if i % 2:
            sampling.update(temperature=0.9, top_p=0.95, seed=1000 + i)
        requests.append(submit_request(f"q{i}", prompt, **sampling))
    return requests


async def _run(model_dir: str, core, async_scheduling: bool, requests, steps: int = 1) -> tuple[dict, dict, int]:
    worker = await start_worker(_config(model_dir, async_scheduling), 0, core=core)
    scheduler = await start(_config(model_dir, async_scheduling, f"127.0.0.1:{worker.port}", steps))
    try:
        async with insecure_channel(f"127.0.0.1:{scheduler.port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            while not scheduler.engine.ready:
                await asyncio.sleep(0.05)
            frontend = Frontend(stub)
            await frontend.send(requests)
            await frontend.wait(lambda: frontend.ended([r.request_id for r in requests]), timeout=240)
            frontend.call.cancel()
            return dict(frontend.tokens), dict(frontend.finish), scheduler.engine.stats().num_preemptions
    finally:
        await scheduler.stop(0.5)
        await worker.stop(None)


@pytest.mark.parametrize("steps", [1, 4, 0], ids=["one-step-plans", "plans-of-4-steps", "auto-plans"])
def test_async_scheduling_gives_the_tokens_of_sync_scheduling_through_the_worker(tmp_path, steps):
    model_dir = str(tmp_path / "tiny")
    save_tiny_model(model_dir, "llama", seed=1)
    save_tiny_tokenizer(model_dir)
    core = build_core(_config(model_dir, True))
    requests = _requests()
    sync_tokens, sync_finish, sync_preempted = asyncio.run(_run(model_dir, core, False, requests))
    multi_step_plans = []
    execute_steps = core.runner.execute_steps
    core.runner.execute_steps = lambda batch, n: multi_step_plans.append(n) or execute_steps(batch, n)
    async_tokens, async_finish, async_preempted = asyncio.run(_run(model_dir, core, True, requests, steps))
    assert sync_preempted > 0 and async_preempted > 0
    assert async_finish == sync_finish and async_tokens == sync_tokens
    # Plans of several steps run only once nothing waits (the tail of this workload, which fills the pool).
    if steps == 4:
        assert len(multi_step_plans) >= 3 and set(multi_step_plans) <= {2, 3, 4}, multi_step_plans
    elif steps == 0:  # the tiny model's decode steps take a few ms: auto groups them
        assert multi_step_plans, "no plan of several steps"
    else:
        assert multi_step_plans == []
    assert any(t[-1] == EOS for t in sync_tokens.values()) or all(r.sampling.ignore_eos for r in requests)
    for r in requests:
        assert 0 < len(sync_tokens[r.request_id]) <= r.sampling.max_tokens


def test_a_plan_whose_requests_all_stopped_ends_early_with_the_tokens_of_one_step_plans(tmp_path):
    """A lone request whose stop token comes 4th or later: its plan of 8 steps ends at the stop, the plan of 8
    sent meanwhile (async scheduling) after one step, and the request ends with the tokens, and finish, of
    one-step plans."""
    model_dir = str(tmp_path / "tiny")
    save_tiny_model(model_dir, "llama", seed=1)
    save_tiny_tokenizer(model_dir)
    core = build_core(_config(model_dir, True))
    prompt = [17, 33, 2, 90, 41]
    free = submit_request("free", prompt, max_tokens=24, ignore_eos=True)
    tokens = asyncio.run(_run(model_dir, core, False, [free]))[0]["free"]
    first = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])  # its first occurrence
    stopped = submit_request("stopped", prompt, max_tokens=24, ignore_eos=True, stop_token_ids=[tokens[first]])
    one_step = asyncio.run(_run(model_dir, core, True, [stopped]))
    plans = []
    execute_steps = core.runner.execute_steps
    core.runner.execute_steps = lambda batch, n: plans.append((n, len(rows := execute_steps(batch, n)))) or rows
    multi_step = asyncio.run(_run(model_dir, core, True, [stopped], steps=8))
    assert one_step[0]["stopped"] == multi_step[0]["stopped"] == tokens[: first + 1]
    assert one_step[1] == multi_step[1]
    # The plan that sampled the stop ended there; one planned meanwhile (if the scheduler planned it before the
    # stop came back: timing) ran one step, for the stop token's K/V.
    assert plans[0] == (8, first) and all(rows == 1 for _, rows in plans[1:]), plans


def test_a_plan_of_requests_that_stopped_before_it_runs_one_step_and_one_still_running_runs_all(tmp_path):
    """The worker's side of a plan already in flight when its requests stopped (deterministic, without the
    scheduler's timing): it computes the K/V of their last token and ends; a running request keeps it going."""
    model_dir = str(tmp_path / "tiny")
    save_tiny_model(model_dir, "llama", seed=1)
    save_tiny_tokenizer(model_dir)
    core = build_core(_config(model_dir, True))
    done, running = request("done", [3, 4, 5], [0, 1], 2, 1), request("running", [6, 7, 8], [2, 3], 2, 1)
    done.sampling.stopped = True
    assert len(core.runner.execute_steps([done], 8)) == 1 and done.num_computed_tokens == 3
    done.num_scheduled_tokens = 1  # as the next plan sets it
    rows = core.runner.execute_steps([done, running], 4)
    assert len(rows) == 8 and (done.num_computed_tokens, running.num_computed_tokens) == (7, 6)
