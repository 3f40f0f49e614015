"""Builders for unit tests of the pure scheduler: plain numbers in, a fake model to answer plans."""

from __future__ import annotations

from services.scheduler.block_pool import BlockPool
from services.scheduler.convert import plan_to_proto, sampled_from_proto
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request, StopConditions
from services.scheduler.scheduler import Scheduler, SchedulerLimits
from services.scheduler.step_plan import RequestOutput, SchedulerOutput
from tests.scheduler.fake_worker import FakeModel, FakeWorkerConfig

VOCAB = 1000


def make_scheduler(
    num_blocks: int,
    block_size: int,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 1024,
    policy: str = "fcfs",
    eos: tuple[int, ...] = (),
    caching: bool = True,
    num_scheduler_steps: int = 1,
    sliding_window: int = 0,
) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks, caching), block_size, sliding_window)
    limits = SchedulerLimits(max_num_seqs, max_num_batched_tokens, max_model_len, policy, num_scheduler_steps)
    return Scheduler(limits, kv, eos)


def make_request(request_id: str, prompt: list[int], max_tokens: int = 16, priority: int = 0, **stop) -> Request:
    return Request(request_id, list(prompt), StopConditions(max_tokens=max_tokens, **stop), priority=priority)


class Driver:
    """The scheduler and a fake model answering its plans through the real proto conversion."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        bs = scheduler.kv.block_size
        config = FakeWorkerConfig(
            num_blocks=scheduler.kv.pool.num_blocks, block_size=bs, sliding_window=scheduler.kv.sliding_window
        )
        self.model = FakeModel(config)
        # Every request's output tokens so far, finished or not.
        self.outputs: dict[str, list[int]] = {}

    def step(self) -> tuple[SchedulerOutput, list[RequestOutput]]:
        out = self.scheduler.schedule()
        return out, self.answer(out)

    def answer(self, out: SchedulerOutput, override: dict[str, int] | None = None) -> list[RequestOutput]:
        """Run ``out`` on the fake model; ``override`` replaces sampled tokens (e.g. to force an EOS)."""
        sampled = sampled_from_proto(self.model.step(plan_to_proto(out)))
        if override:
            sampled = [(rid, override.get(rid, token), lp) for rid, token, lp in sampled]
        results = self.scheduler.update_from_output(out, sampled)
        for r in results:
            self.outputs.setdefault(r.request.request_id, []).append(r.token_id)
        return results

    def run(self, max_steps: int = 1000) -> dict[str, list[int]]:
        """Step until no work is left; returns every request's output tokens."""
        for _ in range(max_steps):
            if not self.scheduler.has_work():
                return self.outputs
            self.step()
        raise AssertionError("did not finish")
