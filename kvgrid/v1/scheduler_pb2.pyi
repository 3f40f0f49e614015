from kvgrid.v1 import common_pb2 as _common_pb2
from kvgrid.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "trace_context", "pooling", "mm_inputs", "lora", "deliver_at_finish")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    MM_INPUTS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    DELIVER_AT_FINISH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: int
    trace_context: _containers.ScalarMap[str, str]
    pooling: _common_pb2.PoolingParams
    mm_inputs: _containers.RepeatedCompositeFieldContainer[_common_pb2.MultiModalInput]
    lora: _common_pb2.LoraRequest
    deliver_at_finish: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., pooling: _Optional[_Union[_common_pb2.PoolingParams, _Mapping]] = ..., mm_inputs: _Optional[_Iterable[_Union[_common_pb2.MultiModalInput, _Mapping]]] = ..., lora: _Optional[_Union[_common_pb2.LoraRequest, _Mapping]] = ..., deliver_at_finish: _Optional[bool] = ...) -> None: ...

class FrontendMessage(_message.Message):
    __slots__ = ("submits", "aborts")
    SUBMITS_FIELD_NUMBER: _ClassVar[int]
    ABORTS_FIELD_NUMBER: _ClassVar[int]
    submits: _containers.RepeatedCompositeFieldContainer[SubmitRequest]
    aborts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, submits: _Optional[_Iterable[_Union[SubmitRequest, _Mapping]]] = ..., aborts: _Optional[_Iterable[str]] = ...) -> None: ...

class SchedulerMessage(_message.Message):
    __slots__ = ("deltas", "load", "kv_events")
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[RequestDelta]
    load: GroupLoad
    kv_events: KvEvents
    def __init__(self, deltas: _Optional[_Iterable[_Union[RequestDelta, _Mapping]]] = ..., load: _Optional[_Union[GroupLoad, _Mapping]] = ..., kv_events: _Optional[_Union[KvEvents, _Mapping]] = ...) -> None: ...

class GroupLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "kv_cache_usage", "lora_adapters")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., lora_adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class KvEvents(_message.Message):
    __slots__ = ("cleared", "block_size", "stored", "removed")
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    cleared: bool
    block_size: int
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, cleared: _Optional[bool] = ..., block_size: _Optional[int] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ...) -> None: ...

class RequestDelta(_message.Message):
    __slots__ = ("request_id", "token_ids", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "logprobs", "error_code", "error_message", "prompt_logprobs", "embedding")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    error_code: int
    error_message: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PromptLogprob]
    embedding: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.PromptLogprob, _Mapping]]] = ..., embedding: _Optional[_Iterable[float]] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "logprobs", "prompt_logprobs", "embedding")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PromptLogprob]
    embedding: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.PromptLogprob, _Mapping]]] = ..., embedding: _Optional[_Iterable[float]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_blocks_total", "num_blocks_used", "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_steps", "worker_ready", "num_cached_free_blocks", "kv_tiers")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    WORKER_READY_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TIERS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_used: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    worker_ready: bool
    num_cached_free_blocks: int
    kv_tiers: _containers.RepeatedCompositeFieldContainer[KvTierStats]
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_blocks_total: _Optional[int] = ..., num_blocks_used: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_steps: _Optional[int] = ..., worker_ready: _Optional[bool] = ..., num_cached_free_blocks: _Optional[int] = ..., kv_tiers: _Optional[_Iterable[_Union[KvTierStats, _Mapping]]] = ...) -> None: ...

class KvTierStats(_message.Message):
    __slots__ = ("tier", "lookup_tokens", "hit_tokens", "saved_bytes", "loaded_bytes", "failed_tokens", "lookup_failures")
    TIER_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FAILED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FAILURES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    lookup_tokens: int
    hit_tokens: int
    saved_bytes: int
    loaded_bytes: int
    failed_tokens: int
    lookup_failures: int
    def __init__(self, tier: _Optional[str] = ..., lookup_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., saved_bytes: _Optional[int] = ..., loaded_bytes: _Optional[int] = ..., failed_tokens: _Optional[int] = ..., lookup_failures: _Optional[int] = ...) -> None: ...

class GetWorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
