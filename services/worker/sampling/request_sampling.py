"""Per-request sampling state: resolved parameters, the output position, and penalty counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvgrid.v1 import common_pb2

if TYPE_CHECKING:
    from services.worker.sampling.structured import TokenConstraint

# Temperatures below this sample like greedy: softmax(logits / T) is one-hot long before T reaches 0.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
# Penalty counts live on the device; tokens appended since are kept in a short list and added each step.
# Past this many, the request's device counts are rewritten so the per-step list stays short.
PENDING_FLUSH_LIMIT = 64


def device_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A per-step host list as a device tensor. On CUDA the copy goes through pinned memory without
    blocking, so building a step's small index/parameter tensors does not stall on the GPU queue."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(slots=True)
class RequestSampling:
    """Sampling state the worker keeps for one request for the request's whole life.

    Build with ``create`` (proto3 zeros resolved to defaults); call ``append`` for each sampled token.
    """

    temperature: float  # 0.0: greedy
    top_p: float  # 1.0: off
    top_k: int  # 0: off
    min_p: float  # 0.0: off
    seed: int | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float  # 1.0: off
    num_logprobs: int  # 0: none
    # Index of the next output token: the seeded noise depends on it, so it survives preemption.
    num_output_tokens: int
    # Seed for the sampler-wide generator that unseeded requests share (the worker's --seed).
    default_seed: int | None = None
    # The tokens that end the request (stop_token_ids, plus EOS unless ignore_eos: the scheduler's stop rule;
    # stop strings are the frontend's), banned while num_output_tokens < min_tokens; and whether it has sampled
    # one since: a plan of several steps ends once each of its requests has.
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    stopped: bool = False
    # Penalty state, only for penalised requests. Until the sampler first sees the request
    # prompt_token_ids holds the prompt; pending_token_ids holds outputs not yet in output_counts.
    prompt_token_ids: list[int] = field(default_factory=list)
    pending_token_ids: list[int] = field(default_factory=list)
    # Kept as one-row matrices so a batch is a torch.cat (torch.stack of 1-D rows is far slower on CPU).
    prompt_mask: torch.Tensor | None = None  # [1, vocab] bool, token occurs in the prompt
    output_counts: torch.Tensor | None = None  # [1, vocab] int32, times each token was generated
    # Structured output: the matcher of the request's constraint (None: unconstrained).
    constraint: TokenConstraint | None = None
    # Derived once from the parameters (fixed after construction): the sampler checks them per row per step.
    greedy: bool = field(init=False)
    penalised: bool = field(init=False)
    argmax_only: bool = field(init=False)  # greedy, no penalties, no logprobs, no constraint

    def __post_init__(self) -> None:
        self.greedy = self.temperature == 0.0
        self.penalised = self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
        self.argmax_only = self.greedy and not self.penalised and self.num_logprobs == 0 and self.constraint is None

    @classmethod
    def create(
        cls,
        params: common_pb2.SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        default_seed: int | None = None,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        constraint: TokenConstraint | None = None,
    ) -> RequestSampling:
        """``output_token_ids`` is non-empty for a request resumed after preemption: they count for
        penalties and for the position of the seeded noise. ``eos_token_ids`` (the model's) are banned,
        with ``stop_token_ids``, until ``min_tokens`` tokens were generated. ``constraint`` is the
        request's structured-output matcher, already advanced over ``output_token_ids``."""
        temperature = params.temperature if params.temperature >= GREEDY_TEMPERATURE else 0.0
        top_p = params.top_p if 0.0 < params.top_p < 1.0 else 1.0
        repetition = params.repetition_penalty if params.repetition_penalty > 0.0 else 1.0
        state = cls(
            temperature=temperature,
            top_p=top_p,
            top_k=max(params.top_k, 0),
            min_p=min(max(params.min_p, 0.0), 1.0),
            seed=params.seed if params.HasField("seed") else None,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=repetition,
            num_logprobs=min(params.logprobs, MAX_LOGPROBS),
            num_output_tokens=len(output_token_ids),
            default_seed=default_seed,
            constraint=constraint,
        )
        state.stop_token_ids = frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else eos_token_ids)
        if params.min_tokens > 0 and state.stop_token_ids:
            state.min_tokens = params.min_tokens
        if state.penalised:
            state.prompt_token_ids = list(prompt_token_ids)
            state.pending_token_ids = list(output_token_ids)
        return state

    @property
    def bans_stop_tokens(self) -> bool:
        """min_tokens is not reached yet: stop tokens may not be sampled this step."""
        return self.num_output_tokens < self.min_tokens

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits is this request's whole sampling step."""
        return self.argmax_only and self.num_output_tokens >= self.min_tokens

    def append(self, token_id: int) -> None:
        """Record a token sampled for this request (the worker calls this once per sampled token)."""
        self.num_output_tokens += 1
        if token_id in self.stop_token_ids and self.num_output_tokens >= self.min_tokens:
            self.stopped = True  # the scheduler ends the request at this token (its stop check)
        if self.constraint is not None:
            self.constraint.advance(token_id)
        if self.penalised:
            self.pending_token_ids.append(token_id)

    def materialize(self, vocab_size: int, device: torch.device) -> None:
        """Create the device penalty state on first use; ids outside the vocabulary are ignored."""
        if self.output_counts is not None:
            return
        prompt = [t for t in self.prompt_token_ids if 0 <= t < vocab_size]
        self.prompt_mask = torch.zeros(1, vocab_size, dtype=torch.bool, device=device)
        if prompt:
            self.prompt_mask[0, device_tensor(prompt, torch.long, device)] = True
        self.output_counts = torch.zeros(1, vocab_size, dtype=torch.int32, device=device)
        self.prompt_token_ids = []
