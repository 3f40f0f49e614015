from kvgrid.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandshakeRequest(_message.Message):
    __slots__ = ("scheduler_id",)
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    scheduler_id: str
    def __init__(self, scheduler_id: _Optional[str] = ...) -> None: ...

class MemoryProfile(_message.Message):
    __slots__ = ("method", "total_bytes", "weights_bytes", "peak_activation_bytes", "non_torch_bytes", "kv_cache_bytes", "gpu_memory_utilization")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_ACTIVATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    NON_TORCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    method: str
    total_bytes: int
    weights_bytes: int
    peak_activation_bytes: int
    non_torch_bytes: int
    kv_cache_bytes: int
    gpu_memory_utilization: float
    def __init__(self, method: _Optional[str] = ..., total_bytes: _Optional[int] = ..., weights_bytes: _Optional[int] = ..., peak_activation_bytes: _Optional[int] = ..., non_torch_bytes: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., gpu_memory_utilization: _Optional[float] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("model", "architecture", "dtype", "device", "block_size", "num_blocks", "bytes_per_block", "max_model_len", "vocab_size", "eos_token_ids", "memory", "tokenizer_files", "max_num_batched_tokens", "max_num_seqs", "worker_id", "load_seconds", "num_host_blocks", "kv_tiers", "sliding_window", "pooler", "multimodal_config", "micro_batches", "max_loras")
    class TokenizerFilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FILES_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TIERS_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    POOLER_FIELD_NUMBER: _ClassVar[int]
    MULTIMODAL_CONFIG_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    dtype: str
    device: str
    block_size: int
    num_blocks: int
    bytes_per_block: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    memory: MemoryProfile
    tokenizer_files: _containers.ScalarMap[str, bytes]
    max_num_batched_tokens: int
    max_num_seqs: int
    worker_id: str
    load_seconds: float
    num_host_blocks: int
    kv_tiers: _containers.RepeatedScalarFieldContainer[str]
    sliding_window: int
    pooler: PoolerConfig
    multimodal_config: str
    micro_batches: int
    max_loras: int
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., memory: _Optional[_Union[MemoryProfile, _Mapping]] = ..., tokenizer_files: _Optional[_Mapping[str, bytes]] = ..., max_num_batched_tokens: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., worker_id: _Optional[str] = ..., load_seconds: _Optional[float] = ..., num_host_blocks: _Optional[int] = ..., kv_tiers: _Optional[_Iterable[str]] = ..., sliding_window: _Optional[int] = ..., pooler: _Optional[_Union[PoolerConfig, _Mapping]] = ..., multimodal_config: _Optional[str] = ..., micro_batches: _Optional[int] = ..., max_loras: _Optional[int] = ...) -> None: ...

class PoolerConfig(_message.Message):
    __slots__ = ("pooling_type", "normalize", "hidden_size")
    POOLING_TYPE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    pooling_type: str
    normalize: bool
    hidden_size: int
    def __init__(self, pooling_type: _Optional[str] = ..., normalize: _Optional[bool] = ..., hidden_size: _Optional[int] = ...) -> None: ...

class KvTierBlock(_message.Message):
    __slots__ = ("block_id", "host_slot", "redis_key")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_SLOT_FIELD_NUMBER: _ClassVar[int]
    REDIS_KEY_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    host_slot: int
    redis_key: str
    def __init__(self, block_id: _Optional[int] = ..., host_slot: _Optional[int] = ..., redis_key: _Optional[str] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "sampling", "block_ids", "num_computed_tokens", "num_scheduled_tokens", "trace_context", "kv_loads", "num_prompt_logprobs_done", "pooling", "mm_inputs", "lora")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    KV_LOADS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_LOGPROBS_DONE_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    MM_INPUTS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    sampling: _common_pb2.SamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    trace_context: _containers.ScalarMap[str, str]
    kv_loads: _containers.RepeatedCompositeFieldContainer[KvTierBlock]
    num_prompt_logprobs_done: int
    pooling: _common_pb2.PoolingParams
    mm_inputs: _containers.RepeatedCompositeFieldContainer[_common_pb2.MultiModalInput]
    lora: _common_pb2.LoraRequest
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., kv_loads: _Optional[_Iterable[_Union[KvTierBlock, _Mapping]]] = ..., num_prompt_logprobs_done: _Optional[int] = ..., pooling: _Optional[_Union[_common_pb2.PoolingParams, _Mapping]] = ..., mm_inputs: _Optional[_Iterable[_Union[_common_pb2.MultiModalInput, _Mapping]]] = ..., lora: _Optional[_Union[_common_pb2.LoraRequest, _Mapping]] = ...) -> None: ...

class RunningRequest(_message.Message):
    __slots__ = ("request_id", "new_block_ids", "num_scheduled_tokens", "num_lookahead_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: int
    num_lookahead_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[int] = ..., num_lookahead_tokens: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_requests", "running", "finished_ids", "kv_saves", "num_steps")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    FINISHED_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_SAVES_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    running: _containers.RepeatedCompositeFieldContainer[RunningRequest]
    finished_ids: _containers.RepeatedScalarFieldContainer[str]
    kv_saves: _containers.RepeatedCompositeFieldContainer[KvTierBlock]
    num_steps: int
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., running: _Optional[_Iterable[_Union[RunningRequest, _Mapping]]] = ..., finished_ids: _Optional[_Iterable[str]] = ..., kv_saves: _Optional[_Iterable[_Union[KvTierBlock, _Mapping]]] = ..., num_steps: _Optional[int] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("request_id", "token_id", "logprob")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    logprob: _common_pb2.TokenLogprob
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled", "execute_seconds", "num_kv_load_failed_tokens", "prompt_logprobs", "pooled")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_LOAD_FAILED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled: _containers.RepeatedCompositeFieldContainer[SampledToken]
    execute_seconds: float
    num_kv_load_failed_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    pooled: _containers.RepeatedCompositeFieldContainer[PooledOutput]
    def __init__(self, step_id: _Optional[int] = ..., sampled: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., execute_seconds: _Optional[float] = ..., num_kv_load_failed_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., pooled: _Optional[_Iterable[_Union[PooledOutput, _Mapping]]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("request_id", "start", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    start: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PromptLogprob]
    def __init__(self, request_id: _Optional[str] = ..., start: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.PromptLogprob, _Mapping]]] = ...) -> None: ...

class PooledOutput(_message.Message):
    __slots__ = ("request_id", "data")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    data: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_id: _Optional[str] = ..., data: _Optional[_Iterable[float]] = ...) -> None: ...
