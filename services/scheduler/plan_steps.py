"""How many decode steps one plan stands for (``--num-scheduler-steps``, StepPlan.num_steps).

While every running request decodes one token and none waits, a plan may stand
for several decode steps: the worker runs the batch that many times and answers
once. Each plan and result costs every process on the way a fixed amount
(serializing, the stream, waking the event loops): at batch 1 on two CPU cores
that was ~2 ms of CPU per 8 ms step. A fixed setting gives the count; 0 (auto)
takes as many as fit in ``PLAN_SECONDS`` at the last decode-only step's time,
so only short steps are grouped, and a request arriving meanwhile waits about
that long at most for its prefill. The scheduler allocates the blocks of all
the plan's tokens up front, and a request that stops within the plan (EOS, a
stop token) drops the tokens sampled after its stop. The worker ends a plan
early once every request in it has sampled a stop token, so a lone request's
EOS is answered at once however long its plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.scheduler.request import Request

if TYPE_CHECKING:
    from services.scheduler.step_plan import SchedulerOutput

# Auto: plans of decode steps up to this long in all, of at most MAX_PLAN_STEPS steps.
PLAN_SECONDS = 0.05
MAX_PLAN_STEPS = 16


def describe(setting: int) -> str:
    """The setting as the log shows it."""
    if setting == 0:
        return f"auto (as many as fit in {PLAN_SECONDS * 1000:g} ms, at most {MAX_PLAN_STEPS})"
    return str(setting)


class PlanSteps:
    """The setting (a count, or 0 for auto) and the last decode-only step's time the worker reported."""

    __slots__ = ("setting", "decode_step_seconds")

    def __init__(self, setting: int):
        self.setting = setting
        self.decode_step_seconds = 0.0  # none yet: auto plans one step until one is timed

    def record(self, out: SchedulerOutput, seconds: float) -> None:
        """The time the worker took for ``out``; a decode-only plan's per-step time sizes auto plans."""
        if not out.new_requests and out.total_num_scheduled_tokens == len(out.running) > 0:
            self.decode_step_seconds = seconds / out.num_steps

    def count(self, running: Sequence[Request], num_waiting: int, budget: int, max_seq_len: int) -> int:
        """Steps the next plan may stand for: 1 unless nothing waits and every running request decodes one
        token that fits the budget (none with structured output); never past a request's max_tokens or the
        longest sequence. A request whose token in flight ends it is not planned at all, so it sets no cap."""
        limit = self.setting
        if limit == 0:
            seconds = self.decode_step_seconds
            limit = min(MAX_PLAN_STEPS, int(PLAN_SECONDS / seconds)) if seconds > 0 else 1
        if limit <= 1 or num_waiting or len(running) > budget:
            return 1
        for request in running:
            known = len(request.all_token_ids) + request.num_output_placeholders
            if known - request.num_computed_tokens != 1 or request.stop.structured:
                return 1
            left = min(request.stop.max_tokens - (known - request.num_prompt_tokens), max_seq_len - known)
            if left > 0:
                limit = min(limit, left)
        return limit
