"""A request as the scheduler sees it: token ids, stop conditions, state and progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from services.scheduler.prefix_hash import BlockHash

DEFAULT_MAX_TOKENS = 16


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"


@dataclass(slots=True)
class StopConditions:
    """The token-id stop conditions (stop strings belong to the frontend)."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    # Structured output: the worker's grammar ends the request (it allows only EOS once complete), so it is
    # planned one step at a time (a plan of several steps would sample past the grammar's end).
    structured: bool = False


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    stop: StopConditions = field(default_factory=StopConditions)
    # Opaque to the scheduler: handed to the worker as is (a SamplingParams message in the service).
    sampling: Any = None
    priority: int = 0
    arrival_seq: int = 0
    # Monotonic seconds at arrival (for the queue-time metric).
    arrival_time: float = 0.0
    trace_context: dict[str, str] = field(default_factory=dict)
    # Opaque like sampling: a pooling request's PoolingParams. It is prefill only: the step that computes its last
    # prompt token ends it with the worker's pooled vector, and nothing is sampled for it.
    pooling: Any = None
    # Every prompt token must be computed (no prefix-cache hit): mean and cls pooling read all of them.
    skip_prefix_cache: bool = False
    # The prompt's images: opaque inputs for the worker (MultiModalInput messages in the service), and their
    # placeholder runs as (offset, length, content hash), which key the prefix cache and the encoder budget.
    mm_inputs: list[Any] = field(default_factory=list)
    mm_spans: list[tuple[int, int, str]] = field(default_factory=list)
    # Opaque like sampling: the LoraRequest (name, path) handed to the worker; None for the base model.
    lora: Any = None
    # The adapter's name ("" for the base model): at most --max-loras distinct ones run at once.
    lora_name: str = ""
    # Seeds the request's block hash chain, so adapters never share KV blocks (see block_hash.cache_salt).
    cache_salt: int | None = None

    status: RequestStatus = RequestStatus.WAITING
    # Prompt followed by outputs; the last token has no K/V yet once anything was sampled.
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at first admission (-1: not admitted yet).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    # Hashes of the full blocks of all_token_ids, extended lazily.
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Keys of the same blocks in the shared KV tier (strong digests, see services.common.kv_keys), extended lazily.
    tier_keys: list[str] = field(default_factory=list)
    # Whether the worker holds state for this request (it was sent in a NewRequest and not dropped since).
    on_worker: bool = False
    # How many of the request's block ids the worker knows.
    num_blocks_sent: int = 0
    # Tokens planned to be sampled whose ids are not back yet (0 or 1 in sync mode between steps, up to 2 with
    # async scheduling). The next plan counts them as known: the worker computes the token it sampled itself.
    num_output_placeholders: int = 0
    # SamplingParams.prompt_logprobs is set; how many prompt positions (from 1) have their logprob here, and
    # those not handed on yet (see services.scheduler.prompt_logprobs).
    wants_prompt_logprobs: bool = False
    num_prompt_logprobs: int = 0
    prompt_logprobs: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    def sort_key(self) -> tuple[int, int]:
        """Order under the priority policy: lower priority value first, then arrival."""
        return (self.priority, self.arrival_seq)
