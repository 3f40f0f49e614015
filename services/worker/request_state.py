"""Per-request state the worker keeps between steps, updated from each StepPlan's new requests and diffs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvgrid.v1 import common_pb2, worker_pb2
from services.common.errors import InvalidArgument
from services.common.pooling import check_resolved, check_runner
from services.worker.multimodal.inputs import ImageInput
from services.worker.pooling.pooler import PoolingState
from services.worker.sampling.request_sampling import RequestSampling

SamplingFactory = Callable[[common_pb2.SamplingParams, list[int], list[int]], RequestSampling]


@dataclass(slots=True)
class RequestState:
    request_id: str
    token_ids: list[int]  # prompt + every output known so far, including tokens this worker sampled
    num_prompt_tokens: int
    block_ids: list[int]  # append-only block table
    num_computed_tokens: int  # leading tokens whose K/V are in the cache
    sampling: RequestSampling
    num_scheduled_tokens: int = 0  # tokens to compute in the current step
    trace_context: dict[str, str] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs (-1: unset), the next prompt position to score, and what the last step
    # scored, until the servicer takes it (see services.worker.sampling.prompt_logprobs).
    prompt_logprobs: int = -1
    prompt_logprobs_next: int = 1
    prompt_logprobs_out: list = field(default_factory=list)
    pooling: PoolingState | None = None  # a pooling request: its prompt is pooled, nothing is sampled
    mm_inputs: list[ImageInput] = field(default_factory=list)  # the prompt's images, in prompt order
    # Speculative decoding (services.worker.spec_decode): slots the plan gave for proposals this step, how many
    # proposals the step carries (appended to token_ids until verified), and the request's acceptance backoff.
    num_lookahead_tokens: int = 0
    num_drafts: int = 0
    spec_backoff: Any = None
    # Method draft_model: leading tokens whose K/V the draft model's cache holds (-1: not seen by it yet).
    draft_num_computed: int = -1
    lora: tuple[str, str] | None = None  # (name, path) of its LoRA adapter; None: the base model

    @property
    def samples_this_step(self) -> bool:
        """After this step every known token is computed, so the next one can be sampled."""
        return self.num_computed_tokens + self.num_scheduled_tokens == len(self.token_ids)


class RequestStates:
    """All requests of one Execute stream; a new stream starts empty."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        vocab_size: int,
        max_model_len: int,
        make_sampling: SamplingFactory,
        pooling: bool = False,
        takes_images: bool = False,
        lora: bool = False,
    ):
        """``pooling``: the worker runs the model as a pooling model (--runner pooling) and takes pooling requests
        only; otherwise generation requests only."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.make_sampling = make_sampling
        self.pooling = pooling
        self.takes_images = takes_images  # a vision-language model: requests may carry images
        self.lora = lora  # the worker serves LoRA adapters (--enable-lora)
        self.requests: dict[str, RequestState] = {}

    def apply(self, plan: worker_pb2.StepPlan) -> list[RequestState]:
        """Drop finished ids, add new requests, apply diffs; returns the requests scheduled this step.

        Validates the whole plan before changing anything, so a bad plan leaves the state as it was.
        """
        dropped = set(plan.finished_ids)
        seen: set[str] = set()
        num_steps = max(plan.num_steps, 1)
        if num_steps > 1 and (plan.new_requests or not plan.running):
            raise InvalidArgument(
                "num_steps", f"a plan of {num_steps} steps repeats running decodes only (it has new requests or none)"
            )
        for new in plan.new_requests:
            self._check_new(new, dropped, seen)
        for run in plan.running:
            self._check_running(run, dropped, seen, num_steps)
        for request_id in plan.finished_ids:
            self.requests.pop(request_id, None)
        scheduled = []
        for new in plan.new_requests:
            token_ids = list(new.token_ids)
            prompt = token_ids[: new.num_prompt_tokens]
            state = RequestState(
                request_id=new.request_id,
                token_ids=token_ids,
                num_prompt_tokens=new.num_prompt_tokens,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling=self.make_sampling(new.sampling, prompt, token_ids[new.num_prompt_tokens :]),
                num_scheduled_tokens=new.num_scheduled_tokens,
                trace_context=dict(new.trace_context),
                pooling=PoolingState.from_proto(new.pooling) if new.HasField("pooling") else None,
                mm_inputs=[ImageInput.from_proto(new.request_id, m, new.num_prompt_tokens) for m in new.mm_inputs],
                lora=(new.lora.name, new.lora.path) if new.HasField("lora") else None,
            )
            if new.sampling.HasField("prompt_logprobs"):
                state.prompt_logprobs = new.sampling.prompt_logprobs
                state.prompt_logprobs_next = 1 + new.num_prompt_logprobs_done
            self.requests[new.request_id] = state
            scheduled.append(state)
        for run in plan.running:
            state = self.requests[run.request_id]
            state.block_ids.extend(run.new_block_ids)
            state.num_scheduled_tokens = run.num_scheduled_tokens
            state.num_lookahead_tokens = run.num_lookahead_tokens
            scheduled.append(state)
        return scheduled

    def _check_new(self, new: worker_pb2.NewRequest, dropped: set[str], seen: set[str]) -> None:
        rid = new.request_id
        if not rid:
            raise InvalidArgument("new_requests.request_id", "must not be empty")
        if rid in seen or (rid in self.requests and rid not in dropped):
            raise InvalidArgument("new_requests.request_id", f"request {rid!r} is already known to the worker")
        seen.add(rid)
        n = len(new.token_ids)
        if n == 0 or not 0 < new.num_prompt_tokens <= n:
            raise InvalidArgument("new_requests.num_prompt_tokens", f"{rid}: must be in [1, {n}] (token_ids: {n})")
        if max(new.token_ids) >= self.vocab_size:
            raise InvalidArgument("new_requests.token_ids", f"{rid}: token id past the vocabulary ({self.vocab_size})")
        self._check_blocks(rid, "new_requests.block_ids", new.block_ids)
        self._check_pooling(new)
        if new.mm_inputs and not self.takes_images:
            raise InvalidArgument("new_requests.mm_inputs", f"{rid}: the model takes text only, no images")
        for m in new.mm_inputs:
            ImageInput.from_proto(rid, m, new.num_prompt_tokens)
        if new.HasField("lora") and not (self.lora and new.lora.name and new.lora.path):
            why = "needs a name and a path" if self.lora else "this worker serves no LoRA adapters (--enable-lora)"
            raise InvalidArgument("new_requests.lora", f"{rid}: {why}")
        self._check_span(rid, "new_requests", new.num_computed_tokens, new.num_scheduled_tokens, n, len(new.block_ids))

    def _check_running(self, run: worker_pb2.RunningRequest, dropped: set[str], seen: set[str], num_steps: int) -> None:
        rid = run.request_id
        if rid in seen:
            raise InvalidArgument("running.request_id", f"request {rid!r} appears twice in the step")
        seen.add(rid)
        state = self.requests.get(rid)
        if state is None or rid in dropped:
            raise InvalidArgument("running.request_id", f"request {rid!r} is not known to the worker")
        self._check_blocks(rid, "running.new_block_ids", run.new_block_ids)
        num_blocks = len(state.block_ids) + len(run.new_block_ids)
        known = len(state.token_ids)
        if num_steps > 1:
            # Each step computes the token the one before sampled: the request must sample from the first step on.
            if run.num_scheduled_tokens != 1 or state.num_computed_tokens + 1 != known:
                raise InvalidArgument(
                    "num_steps", f"{rid}: a plan of {num_steps} steps repeats decodes only (1 token that samples)"
                )
            known += num_steps - 1  # the tokens the run samples before computing them
        self._check_span(
            rid, "running", state.num_computed_tokens, run.num_scheduled_tokens + num_steps - 1, known, num_blocks
        )
        if run.num_lookahead_tokens:
            self._check_lookahead(rid, state, run, num_steps, num_blocks)

    def _check_lookahead(
        self, rid: str, state: RequestState, run: worker_pb2.RunningRequest, num_steps: int, num_blocks: int
    ) -> None:
        """Proposals follow a decode token in a plan of one step, in slots the blocks hold."""
        if num_steps > 1 or run.num_scheduled_tokens != 1 or state.num_computed_tokens + 1 != len(state.token_ids):
            raise InvalidArgument("running.num_lookahead_tokens", f"{rid}: lookahead needs a decode in a 1-step plan")
        end = len(state.token_ids) + run.num_lookahead_tokens
        if end > self.max_model_len or end > num_blocks * self.block_size:
            raise InvalidArgument(
                "running.num_lookahead_tokens", f"{rid}: {end} positions past max_model_len or its blocks"
            )

    def _check_pooling(self, new: worker_pb2.NewRequest) -> None:
        rid, pooled = new.request_id, new.HasField("pooling")
        check_runner("new_requests.pooling", pooled, self.pooling)
        if not pooled:
            return
        check_resolved(new.pooling)
        if new.num_prompt_tokens != len(new.token_ids):
            raise InvalidArgument("new_requests.token_ids", f"{rid}: a pooling request has no output tokens")
        params = new.pooling
        if params.pooling_type != "last" and new.num_computed_tokens:
            raise InvalidArgument(
                "new_requests.num_computed_tokens",
                f"{rid}: {params.pooling_type} pooling needs every prompt token computed",
            )

    def _check_blocks(self, rid: str, where: str, block_ids) -> None:
        if block_ids and max(block_ids) >= self.num_blocks:
            raise InvalidArgument(where, f"{rid}: block id {max(block_ids)} past the cache ({self.num_blocks} blocks)")

    def _check_span(self, rid: str, where: str, computed: int, scheduled: int, known: int, num_blocks: int) -> None:
        end = computed + scheduled
        if scheduled == 0 or end > known:
            raise InvalidArgument(
                f"{where}.num_scheduled_tokens", f"{rid}: {computed} computed + {scheduled} scheduled, {known} known"
            )
        if end > self.max_model_len:
            raise InvalidArgument(f"{where}.num_scheduled_tokens", f"{rid}: {end} tokens exceed max_model_len")
        if num_blocks * self.block_size < end:
            raise InvalidArgument(f"{where}.block_ids", f"{rid}: {num_blocks} blocks cannot hold {end} tokens")
