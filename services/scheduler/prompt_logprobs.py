"""Prompt logprobs on the scheduler's side: which requests need them, and their arrival from the worker.

A request that asks (SamplingParams.prompt_logprobs) needs a logprob for each prompt token after the first. The
worker scores them as it computes the prompt, chunk by chunk; they gather on the request and leave with its first
token. Until all are in, the request reads nothing from the prefix cache or the KV tiers: a position whose K/V come
from a cache is never computed, so its token would go unscored (vLLM does the same). A request preempted or
moved to another worker keeps what arrived; the worker is told how many it has, and any that arrive twice (a step
in flight at the preemption) are dropped here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from services.scheduler.request import Request

# (request_id, prompt position of the first entry, entries): one request's logprobs of one step.
PromptLogprobsChunk = tuple[str, int, list[Any]]


class PromptLogprobsError(RuntimeError):
    """The worker skipped prompt positions the scheduler did not have."""


def needs_prompt_logprobs(request: Request) -> bool:
    """The request still misses some of its prompt logprobs (so every prompt position must be computed)."""
    return request.wants_prompt_logprobs and request.num_prompt_logprobs < request.num_prompt_tokens - 1


def accept(planned: dict[str, Request], live: dict[str, Request], chunks: Iterable[PromptLogprobsChunk]) -> None:
    """Add each chunk's new entries to the request the plan computed them for, if it is still live."""
    for request_id, start, entries in chunks:
        request = planned.get(request_id)
        if request is None or live.get(request_id) is not request:
            continue  # aborted or finished meanwhile
        next_position = request.num_prompt_logprobs + 1
        if start > next_position:
            raise PromptLogprobsError(
                f"prompt logprobs of {request_id!r} from position {start}, expected {next_position} or before"
            )
        new = entries[next_position - start :]
        request.prompt_logprobs.extend(new)
        request.num_prompt_logprobs += len(new)


def take(request: Request) -> list[Any] | None:
    """The prompt logprobs gathered for the request not handed on yet (all of them, with its first token)."""
    if not request.prompt_logprobs:
        return None
    entries, request.prompt_logprobs = request.prompt_logprobs, []
    return entries
