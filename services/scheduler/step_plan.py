"""What one scheduler step sends the worker (``SchedulerOutput``: new requests in full, running ones as what
changed) and what comes back per request (``RequestOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.scheduler.kv_tiers import TierBlock
from services.scheduler.request import Request, RequestStatus


@dataclass(slots=True)
class NewRequestPlan:
    """A request the worker does not hold: sent in full."""

    request: Request
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    # The step reaches the end of the request's tokens, so the worker samples one for it.
    samples: bool = False
    # Blocks the worker fills from the KV tiers first; num_computed_tokens counts them.
    kv_loads: list[TierBlock] = field(default_factory=list)


@dataclass(slots=True)
class RunningRequestPlan:
    """A request the worker holds: only blocks appended since the last step and the token count."""

    request: Request
    new_block_ids: list[int]
    num_scheduled_tokens: int
    samples: bool = False
    # Speculative decoding: slots for proposed tokens after the scheduled one (see ``lookahead``).
    num_lookahead_tokens: int = 0


@dataclass(slots=True)
class SchedulerOutput:
    step_id: int
    new_requests: list[NewRequestPlan] = field(default_factory=list)
    running: list[RunningRequestPlan] = field(default_factory=list)
    # Requests the worker must drop before the step: finished, aborted or preempted since the last plan.
    finished_ids: list[str] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    # Device blocks the worker copies out to the KV tiers before anything else in the step.
    kv_saves: list[TierBlock] = field(default_factory=list)
    # Decode steps the plan stands for: each request's tokens are computed and sampled this many times.
    num_steps: int = 1

    def kv_loads(self) -> list[TierBlock]:
        return [load for new in self.new_requests for load in new.kv_loads]

    @property
    def is_empty(self) -> bool:
        """Nothing to compute, drop or save: no need to send it."""
        return not self.total_num_scheduled_tokens and not self.finished_ids and not self.kv_saves


@dataclass(slots=True)
class RequestOutput:
    """One sampled token of one request, and how the request ended if it did."""

    request: Request
    token_id: int
    logprob: Any = None
    finish: RequestStatus | None = None
    # The request's prompt logprobs (SamplingParams.prompt_logprobs), on its first token only.
    prompt_logprobs: list[Any] | None = None
    pooled: Any = None  # a pooling request's vector (its only output; token_id means nothing then)
