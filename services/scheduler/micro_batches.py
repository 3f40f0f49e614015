"""Micro-batches for a pipeline of stages: plans in flight at once over disjoint requests.

A worker of P pipeline stages (``HandshakeResponse.micro_batches`` = P) runs stage s of one plan while stage
s+1 runs the plan before it, provided no request is in both: a request's next step needs the token its last
step samples, and its computed count, which only the end of the pipeline gives. So while plans are in
flight the scheduler plans only the requests none of them holds (``waits``), at most a P-th of the running
ones per plan (``share``): the running requests split into up to P micro-batches. A waiting request that an
in-flight plan still holds (one preempted after it was planned) is not admitted again until that plan's
result is back.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.request import Request
    from services.scheduler.step_plan import SchedulerOutput


class MicroBatches:
    """The requests of the plans in flight (how many plans hold each)."""

    __slots__ = ("count", "_held")

    def __init__(self, count: int):
        self.count = count  # plans the worker runs at once: its pipeline stages
        self._held: Counter[str] = Counter()

    def waits(self, request: Request) -> bool:
        """Whether a plan in flight holds ``request``: it is not planned again until that plan's result is back."""
        return request.request_id in self._held

    def share(self, num_running: int) -> int:
        """Running requests one plan takes at most: an equal share per stage, so the stages all have work."""
        return -(-num_running // self.count)

    def sent(self, out: SchedulerOutput) -> None:
        self._held.update(plan.request.request_id for plan in (*out.running, *out.new_requests))

    def done(self, out: SchedulerOutput) -> None:
        self._held.subtract(plan.request.request_id for plan in (*out.running, *out.new_requests))
        self._held = +self._held  # drop the zero counts
