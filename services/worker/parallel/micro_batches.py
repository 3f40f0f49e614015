"""Rank 0's side of micro-batches: several plans in the pipeline at once, stage s on one while s+1 runs another.

``launch`` prepares a plan's step, sends it to the other ranks and runs stage 0 (its output leaves with a
non-blocking send), so rank 0 can start the next plan while the later stages compute this one; ``complete``
takes the oldest plan's output from the last stage (plans come back in the order they started), computes the
logits, samples and commits, as ``ModelRunner.execute`` does. A plan joins the pipeline only when none of its
requests is in a plan there (its step needs their tokens and computed counts, which only the end of the
pipeline gives) and it is one step (``StepPlan.num_steps`` 1); otherwise the pipeline drains first and the
plan runs whole. The scheduler sends such disjoint plans when the handshake says ``micro_batches`` > 1.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from services.worker.model_runner import ModelRunner, SampledRow, StepInputs
from services.worker.request_state import RequestState

log = logging.getLogger(__name__)


@dataclass(slots=True)
class InFlight:
    """A plan in the pipeline: its requests, when it arrived, and its step's inputs (None: nothing to compute)."""

    plan: object  # worker_pb2.StepPlan
    scheduled: list[RequestState]
    started: float
    inputs: StepInputs | None = None
    num_tokens: int = 0
    request_ids: frozenset[str] = field(default_factory=frozenset)


class MicroBatchPipeline:
    """Up to ``depth`` plans (the pipeline's stages) in flight on rank 0's runner, whose model is a StagedModel."""

    def __init__(self, runner: ModelRunner, depth: int):
        self.runner, self.depth = runner, depth
        self.pending: deque[InFlight] = deque()
        self.peak = 0  # the most plans that were in the pipeline at once

    @property
    def full(self) -> bool:
        return len(self.pending) >= self.depth

    def takes(self, plan, scheduled: list[RequestState]) -> bool:
        """Whether ``plan`` may join the pipeline now (else drain it and run the plan whole)."""
        if self.full or plan.num_steps > 1:
            return False
        ids = {state.request_id for state in scheduled}
        return not any(ids & step.request_ids for step in self.pending)

    @torch.inference_mode()
    def launch(self, plan, scheduled: list[RequestState], started: float) -> None:
        """Model thread: the plan's step through stage 0, its output on its way to stage 1."""
        step = InFlight(plan, scheduled, started, request_ids=frozenset(s.request_id for s in scheduled))
        if scheduled:
            runner = self.runner
            step.inputs = runner.prepare(scheduled)
            if runner.step_listener is not None:
                runner.step_listener(step.inputs)  # the other ranks' copy of the step
            i = step.inputs
            step.num_tokens = runner.model.start(i.input_ids, i.positions, runner.kv_caches, i.meta)
        self.pending.append(step)
        if len(self.pending) > self.peak:
            self.peak = len(self.pending)
            if self.peak > 1:
                log.info("micro-batches: %d plans in the pipeline at once", self.peak)

    @torch.inference_mode()
    def complete(self) -> tuple[InFlight, list[SampledRow]]:
        """Model thread: the oldest plan's output from the last stage, sampled and committed."""
        step = self.pending.popleft()
        if step.inputs is None:
            return step, []
        runner = self.runner
        hidden = runner.model.finish(step.num_tokens)
        logits, pooled = runner.outputs(step.inputs, hidden)
        return step, runner.commit(step.scheduled, step.inputs, logits, pooled)

    def drain(self) -> None:
        """Model thread: completes the plans left in the pipeline, their results unused (the stream is gone)."""
        while self.pending:
            self.complete()
