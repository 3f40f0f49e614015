"""The in-process step loop: the scheduler core plans, the worker's model runner computes, nothing in between.

Each step is the same exchange the services have over gRPC, minus the wire: the
scheduler's plan becomes the worker's StepPlan message (the one conversion both sides
already share), the worker's request states apply it, the runner executes it, and the
sampled tokens go back to ``SchedulerCore.finish_step``, as the gRPC step loop does.
"""

from __future__ import annotations

import time

from services.common.config import Config
from services.scheduler.admission import AdmissionLimits
from services.scheduler.convert import plan_to_proto
from services.scheduler.core import SchedulerCore, StepCounters
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.scheduler.step_plan import RequestOutput
from services.worker.core import WorkerCore
from services.worker.sampling import prompt_logprobs

# What LLM.stats() returns: the scheduler core's counters since the LLM was built.
EngineStats = StepCounters


class OfflineEngine:
    def __init__(self, core: WorkerCore, config: Config):
        self.core = core
        self.scheduler_core = SchedulerCore.for_worker(core.handshake, config)
        self.states = core.request_states()

    @property
    def scheduler(self) -> Scheduler:
        return self.scheduler_core.scheduler

    @property
    def admission(self) -> AdmissionLimits:
        return self.scheduler_core.admission

    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> None:
        """Frees the request's blocks now; the worker drops its state with the next step."""
        self.scheduler.abort_request(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        out = self.scheduler_core.plan()
        if out.is_empty:
            raise RuntimeError(
                f"the scheduler planned nothing with {self.scheduler.num_waiting} requests waiting and "
                f"{self.scheduler.num_running} running"
            )
        plan = plan_to_proto(out)
        self.core.check_plan(plan)
        started = time.perf_counter()
        scheduled = self.states.apply(plan)
        rows, num_failed = self.core.execute(plan, scheduled)
        seconds = time.perf_counter() - started
        sampled = [(r.request.request_id, r.token_id, r.logprob) for r in rows if r.pooled is None]
        pooled = {r.request.request_id: r.pooled for r in rows if r.pooled is not None}
        scored = [(c.request_id, c.start, list(c.logprobs)) for c in prompt_logprobs.take(scheduled)]
        return self.scheduler_core.finish_step(out, sampled, seconds, num_failed, scored, pooled)

    def stats(self) -> EngineStats:
        return self.scheduler_core.counters()
