"""The in-process step loop: the scheduler core plans, the worker's model runner computes, nothing in between.

Each step is the same exchange the services have over gRPC, minus the wire: the
scheduler's plan becomes the worker's StepPlan message (the one conversion both sides
already share), the worker's request states apply it, the runner executes it, and the
sampled tokens go back to ``update_from_output``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from services.common.config import Config
from services.scheduler.convert import plan_to_proto
from services.scheduler.engine import build_scheduler
from services.scheduler.request import Request
from services.scheduler.scheduler import RequestOutput
from services.worker.core import WorkerCore


@dataclass(slots=True)
class EngineStats:
    num_steps: int
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found


class OfflineEngine:
    def __init__(self, core: WorkerCore, config: Config):
        self.core = core
        self.scheduler, self.admission = build_scheduler(core.handshake, config)
        self.states = core.request_states()
        self.num_steps = 0

    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> None:
        """Frees the request's blocks now; the worker drops its state with the next step."""
        self.scheduler.abort_request(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            raise RuntimeError(
                f"the scheduler planned nothing with {self.scheduler.num_waiting} requests waiting and "
                f"{self.scheduler.num_running} running"
            )
        plan = plan_to_proto(out)
        self.core.check_plan(plan)
        started = time.perf_counter()
        rows, num_failed = self.core.execute(plan, self.states.apply(plan))
        self.scheduler.plan_steps.record(out, time.perf_counter() - started)
        if num_failed:
            self.scheduler.tiers.record_failed_loads(num_failed, out.kv_loads())
        self.num_steps += out.num_steps
        return self.scheduler.update_from_output(out, [(r.request.request_id, r.token_id, r.logprob) for r in rows])

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(self.num_steps, s.num_preemptions, s.kv.prefix_queries, s.kv.prefix_hits)
