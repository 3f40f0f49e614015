"""The configuration sections: one dataclass per concern, one field per flag (``--kv-cache-memory``), each
also a ``KVGRID_*`` variable. ``config`` builds them from flags, the environment and these defaults."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from services.common.speculative import SpeculativeConfig, parse_speculative_config

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def model_name(model: str) -> str:
    """The served name for a --model value: the directory or file name without extension."""
    if not model:
        return DEFAULT_MODEL_NAME
    base = os.path.basename(os.path.normpath(model))
    return base[: -len(".gguf")] if base.lower().endswith(".gguf") else base


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None, parse=None, many: bool = False):
    """``many``: the flag takes several values (``--lora-modules a=/x b=/y``), joined by spaces into the string."""
    return field(default=default, metadata={"help": help, "choices": choices, "parse": parse, "many": many})


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """'4GiB', '512M', '1000000' -> bytes."""
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 2GiB, 512MiB or a byte count)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


RUNNERS = ("generate", "pooling")
POOLING_TYPES = ("last", "mean", "cls")
TASKS = ("auto", "generate", "embed")


@dataclass(slots=True)
class ModelConfig:
    model: str = _opt("", "HF model directory, GGUF file, or empty for the embedded SmolLM2-135M-Instruct")
    served_model_name: str = _opt("", "name reported to clients (default: derived from --model)")
    tokenizer: str = _opt("", "tokenizer directory for the frontend (default: files sent by the worker)")
    dtype: str = _opt("auto", "weight and KV cache dtype", ("auto", "bfloat16", "float16", "float32"))
    max_model_len: int = _opt(0, "longest sequence in tokens (0: the model's own limit)")
    seed: int = _opt(0, "seed for requests that give none")
    runner: str = _opt(
        "generate",
        "what the worker runs the model as: generate (completions, chat) or pooling (embeddings: /v1/embeddings)",
        RUNNERS,
    )
    pooling_type: str = _opt(
        "last", "pooling runner: how a prompt's hidden states become one vector by default", POOLING_TYPES
    )
    normalize: bool = _opt(True, "pooling runner: scale vectors to unit L2 norm unless a request says otherwise")
    task: str = _opt("auto", "vLLM's older name for --runner: embed means pooling (auto: as --runner says)", TASKS)

    def __post_init__(self) -> None:
        if self.task == "embed":
            self.runner = "pooling"

    def validate(self) -> list[str]:
        errors = []
        if self.max_model_len < 0:
            errors.append(f"--max-model-len must be >= 0, got {self.max_model_len}")
        if self.task == "generate" and self.runner != "generate":
            errors.append(f"--task generate contradicts --runner {self.runner}")
        return errors

    @property
    def name(self) -> str:
        return self.served_model_name or model_name(self.model)


@dataclass(slots=True)
class LoadConfig:
    load_format: str = _opt("auto", "weight file format", ("auto", "safetensors", "gguf"))
    quantization: str = _opt(
        "none",
        "CPU weights: none (as loaded), int8 (per-channel, quantized at load) or gguf (a GGUF file's blocks)",
        ("none", "int8", "gguf"),
    )

    def validate(self) -> list[str]:
        return []


@dataclass(slots=True)
class DeviceConfig:
    device: str = _opt("auto", "where the worker runs the model (auto: cuda if available)", ("auto", "cpu", "cuda"))
    attention_backend: str = _opt(
        "auto", "attention implementation (auto: triton on CUDA, torch on CPU)", ("auto", "torch", "triton")
    )
    cpu_kernels: str = _opt(
        "auto",
        "CPU steps through native C kernels (auto: where a C compiler and AVX2 are present)",
        ("auto", "native", "torch"),
    )
    num_threads: int = _opt(0, "CPU threads for the worker's math (0: all cores)")
    enforce_eager: bool = _opt(False, "no CUDA graphs: run every decode step eagerly (CUDA)")

    def validate(self) -> list[str]:
        return [f"--num-threads must be >= 0, got {self.num_threads}"] if self.num_threads < 0 else []


KV_TIERS = ("host", "redis")


@dataclass(slots=True)
class CacheConfig:
    block_size: int = _opt(16, "tokens per KV cache block")
    kv_cache_memory: int = _opt(
        0, "bytes for the KV cache on CPU, e.g. 2GiB (0: a safe share of free RAM)", parse=parse_bytes
    )
    gpu_memory_utilization: float = _opt(0.9, "fraction of GPU memory kvgrid may use (CUDA)")
    enable_prefix_caching: bool = _opt(True, "reuse KV blocks of identical prompt prefixes")
    kv_tiers: str = _opt(
        "", "KV tiers beyond the device pool, comma-separated: host (evicted blocks), redis (shared); empty: off"
    )
    kv_host_memory: int = _opt(4 * 2**30, "bytes of host memory for the host KV tier, e.g. 4GiB", parse=parse_bytes)
    kv_redis_url: str = _opt("", "Redis (or Valkey) server of the redis KV tier, e.g. redis://host:6379/0")

    @property
    def kv_tier_names(self) -> list[str]:
        return [name.strip() for name in self.kv_tiers.split(",") if name.strip()]

    def validate(self) -> list[str]:
        errors = []
        unknown = [name for name in self.kv_tier_names if name not in KV_TIERS]
        if unknown:
            errors.append(f"--kv-tiers: unknown tier {unknown[0]!r} (use {', '.join(KV_TIERS)})")
        if "host" in self.kv_tier_names and self.kv_host_memory <= 0:
            errors.append(f"--kv-host-memory must be > 0 with the host tier, got {self.kv_host_memory}")
        if "redis" in self.kv_tier_names and not self.kv_redis_url.startswith(("redis://", "rediss://", "unix://")):
            errors.append(
                f"--kv-redis-url must be redis://HOST:PORT[/DB] with the redis tier, got {self.kv_redis_url!r}"
            )
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            errors.append(f"--block-size must be a power of two from 1 to 128, got {self.block_size}")
        if self.kv_cache_memory < 0:
            errors.append(f"--kv-cache-memory must be >= 0, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            errors.append(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        return errors


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = _opt(128, "most requests running in one step")
    max_num_batched_tokens: int = _opt(2048, "most tokens computed in one step (the chunked-prefill budget)")
    max_waiting_requests: int = _opt(4096, "queue length past which Submit answers RESOURCE_EXHAUSTED")
    scheduling_policy: str = _opt("fcfs", "admission and preemption order", ("fcfs", "priority"))
    async_scheduling: bool = _opt(
        True, "plan each step while the worker runs the previous one (the worker feeds its sampled token forward)"
    )
    num_scheduler_steps: int = _opt(
        0,
        "decode steps one plan may stand for while every running request decodes and none waits"
        " (0: auto, as many as fit in 50 ms at the last decode step's time, at most 8)",
    )
    worker_reconnect_timeout: float = _opt(
        180.0, "seconds the requests of a lost worker wait for a worker to resume them before failing (UNAVAILABLE)"
    )
    speculative_config: str = _opt(
        "",
        'speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
        " (see docs/speculative-decoding.md); empty: off",
    )

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return parse_speculative_config(self.speculative_config)

    def validate(self) -> list[str]:
        errors = []
        if self.max_num_seqs < 1:
            errors.append(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            errors.append(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_waiting_requests < 1:
            errors.append(f"--max-waiting-requests must be >= 1, got {self.max_waiting_requests}")
        if self.num_scheduler_steps < 0:
            errors.append(f"--num-scheduler-steps must be >= 0 (0: auto), got {self.num_scheduler_steps}")
        if self.worker_reconnect_timeout < 0:
            errors.append(f"--worker-reconnect-timeout must be >= 0, got {self.worker_reconnect_timeout}")
        try:
            parse_speculative_config(self.speculative_config)
        except ValueError as e:
            errors.append(f"--speculative-config: {e}")
        return errors


@dataclass(slots=True)
class ParallelConfig:
    tensor_parallel_size: int = _opt(
        1, "devices one worker shards the model over, one process each (must divide the attention and KV heads)"
    )

    pipeline_parallel_size: int = _opt(
        1,
        "pipeline stages: the layers split into this many contiguous ranges, each run by --tensor-parallel-size ranks",
    )
    distributed_init_method: str = _opt(
        "",
        "rendezvous of the ranks, tcp://HOST:PORT on rank 0's host (empty: MASTER_ADDR/MASTER_PORT when set,"
        " else a free local port)",
    )
    nnodes: int = _opt(
        1,
        "machines a worker group spreads over, equal shares of its ranks; node 0 runs rank 0, the others worker-rank",
    )
    node_rank: int = _opt(0, "this node's index (kvgrid worker-rank): it runs ranks node_rank*R..(node_rank+1)*R-1")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def validate(self) -> list[str]:
        errors = []
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                errors.append(f"--{_flag(name)} must be >= 1, got {getattr(self, name)}")
        if errors:
            return errors
        if self.world_size % self.nnodes:
            errors.append(
                f"--nnodes {self.nnodes} must divide the {self.world_size} ranks"
                " (--tensor-parallel-size x --pipeline-parallel-size)"
            )
        if self.node_rank < 0:  # its upper bound is rank 0's --nnodes, which kvgrid worker-rank reads from rank 0
            errors.append(f"--node-rank must be >= 0, got {self.node_rank}")
        method = self.distributed_init_method
        if method and not re.fullmatch(r"tcp://[^:/\s]+:\d+|tcp://\[[0-9a-fA-F:]+\]:\d+", method):
            errors.append(f"--distributed-init-method must be tcp://HOST:PORT, got {method!r}")
        return errors


@dataclass(slots=True)
class RoutingConfig:
    scheduler_resolve_interval: float = _opt(10.0, "seconds between DNS lookups of --scheduler-addrs names (0: once)")
    routing_policy: str = _opt(
        "cache-aware",
        "how the frontend picks a group: by prefix-cache overlap and load, or in turn",
        ("cache-aware", "round-robin"),
    )
    routing_prefix_weight: float = _opt(1.0, "score per fraction of the prompt a group holds in its prefix cache")
    routing_load_weight: float = _opt(
        0.5, "score taken off a group per running+waiting request, relative to the busiest group's"
    )
    routing_kv_weight: float = _opt(0.2, "score taken off a group per fraction of its KV cache in use")
    routing_balance_abs_threshold: int = _opt(
        8, "load alone decides when the busiest group has more than this many requests over the idlest ..."
    )
    routing_balance_rel_threshold: float = _opt(1.5, "... and more than this many times as many")

    def validate(self) -> list[str]:
        errors = []
        if self.scheduler_resolve_interval < 0:
            errors.append(f"--scheduler-resolve-interval must be >= 0, got {self.scheduler_resolve_interval}")
        if self.routing_balance_abs_threshold < 0 or self.routing_balance_rel_threshold < 1:
            errors.append("--routing-balance-abs-threshold must be >= 0 and --routing-balance-rel-threshold >= 1")
        return errors


@dataclass(slots=True)
class LifecycleConfig:
    shutdown_grace: float = _opt(
        30.0, "seconds in-flight requests may take to finish after SIGTERM; new ones get UNAVAILABLE meanwhile"
    )

    def validate(self) -> list[str]:
        return [f"--shutdown-grace must be >= 0, got {self.shutdown_grace}"] if self.shutdown_grace < 0 else []


@dataclass(slots=True)
class ObservabilityConfig:
    log_level: str = _opt("info", "log level", ("debug", "info", "warning", "error"))
    log_format: str = _opt("text", "log line format", ("text", "json"))

    def validate(self) -> list[str]:
        return []


@dataclass(slots=True)
class NetworkConfig:
    host: str = _opt("0.0.0.0", "address the servers bind to")
    tokenizer_port: int = _opt(50051, "tokenizer frontend gRPC port (public API)")
    http_port: int = _opt(8000, "tokenizer frontend HTTP port (OpenAI-compatible /v1, /metrics, /health)")
    scheduler_port: int = _opt(50052, "scheduler gRPC port")
    scheduler_metrics_port: int = _opt(8002, "scheduler /metrics port")
    worker_port: int = _opt(50053, "worker gRPC port")
    worker_metrics_port: int = _opt(8003, "worker /metrics port")
    scheduler_addr: str = _opt("localhost:50052", "where the tokenizer frontend reaches the scheduler")
    scheduler_addrs: str = _opt(
        "",
        "the schedulers of all worker groups, HOST:PORT,... or one DNS name resolving to many (a Kubernetes "
        "headless Service); empty: the one --scheduler-addr",
    )
    worker_addr: str = _opt("localhost:50053", "where the scheduler reaches the worker")

    def validate(self) -> list[str]:
        errors = []
        for f in dataclasses.fields(self):
            if f.name.endswith("_port") and not 0 <= getattr(self, f.name) <= 65535:
                errors.append(f"--{_flag(f.name)} must be a port number, got {getattr(self, f.name)}")
        for name in ("scheduler_addr", "worker_addr"):
            if ":" not in getattr(self, name):
                errors.append(f"--{_flag(name)} must be HOST:PORT, got {getattr(self, name)!r}")
        for addr in self.scheduler_addr_list():
            if ":" not in addr:
                errors.append(f"--scheduler-addrs entries must be HOST:PORT, got {addr!r}")
        return errors

    def scheduler_addr_list(self) -> list[str]:
        """The scheduler addresses the frontend starts from: --scheduler-addrs, else --scheduler-addr."""
        listed = (a.strip() for a in self.scheduler_addrs.split(","))
        return list(dict.fromkeys(a for a in listed if a)) or [self.scheduler_addr]


@dataclass(slots=True)
class SecurityConfig:
    """Who may call: API keys on the public API, TLS on its ports, mutual TLS between the services."""

    api_key: str = field(
        default="",
        metadata={
            "help": "API keys the public API accepts, comma-separated (empty and no --api-key-file: open)",
            "choices": None,
            "parse": None,
            # Never on a command line (``ps`` shows it): `kvgrid serve` hands it to the frontend in its environment.
            "secret": True,
        },
    )
    api_key_file: str = _opt("", "file with one API key per line (e.g. a mounted Secret), added to --api-key")
    metrics_require_key: bool = _opt(False, "the frontend's /metrics asks for an API key too")
    tls_cert_file: str = _opt("", "certificate (PEM) of the public ports, HTTP and gRPC; empty: plaintext")
    tls_key_file: str = _opt("", "private key (PEM) of --tls-cert-file")
    tls_ca_file: str = _opt("", "CA (PEM) client certificates of the public ports must chain to; empty: none asked")
    internal_tls_ca: str = _opt("", "CA (PEM) every service's certificate chains to; set the three for mutual TLS")
    internal_tls_cert: str = _opt("", "this service's certificate (PEM) toward the other services")
    internal_tls_key: str = _opt("", "private key (PEM) of --internal-tls-cert")

    def validate(self) -> list[str]:
        errors = []
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            errors.append("--tls-cert-file and --tls-key-file go together")
        if self.tls_ca_file and not self.tls_cert_file:
            errors.append("--tls-ca-file needs --tls-cert-file and --tls-key-file")
        internal = (self.internal_tls_ca, self.internal_tls_cert, self.internal_tls_key)
        if any(internal) and not all(internal):
            errors.append("--internal-tls-ca, --internal-tls-cert and --internal-tls-key go together")
        return errors


@dataclass(slots=True)
class HttpConfig:
    """The frontend's public servers: how many processes share its ports, and for HTTP how long a connection may
    idle or take over its headers, and how many it holds."""

    api_server_count: int = _opt(
        1,
        "frontend processes sharing the public gRPC and HTTP ports (SO_REUSEPORT), each with its own link to the "
        "schedulers: `kvgrid serve` starts this many; a `kvgrid tokenizer` given more than 1 joins such a group",
    )

    http_keep_alive_timeout: float = _opt(5.0, "seconds an idle keep-alive HTTP connection stays open")
    http_header_timeout: float = _opt(
        10.0,
        "seconds a client has to send a request's headers, from the connection's start or the request's first byte",
    )
    http_max_connections: int = _opt(
        1024, "HTTP connections and requests served at once; past it requests get 503 (0: no limit)"
    )
    http_max_header_bytes: int = _opt(
        16 * 2**10, "largest HTTP request line and headers; bigger ones get 400", parse=parse_bytes
    )

    def validate(self) -> list[str]:
        errors = []
        if self.api_server_count < 1:
            errors.append(f"--api-server-count must be >= 1, got {self.api_server_count}")
        for name in ("http_keep_alive_timeout", "http_header_timeout"):
            if not getattr(self, name) > 0:
                errors.append(f"--{_flag(name)} must be > 0, got {getattr(self, name)}")
        if self.http_max_connections < 0:
            errors.append(f"--http-max-connections must be >= 0 (0: no limit), got {self.http_max_connections}")
        if self.http_max_header_bytes < 1024:
            errors.append(f"--http-max-header-bytes must be >= 1024, got {self.http_max_header_bytes}")
        return errors


@dataclass(slots=True)
class LimitsConfig:
    """What one request may cost the frontend, so that no request can stall the others."""

    max_request_bytes: int = _opt(
        16 * 2**20, "largest HTTP body or public gRPC message the frontend reads", parse=parse_bytes
    )
    max_prompt_chars: int = _opt(
        0,
        "longest prompt in characters (chat: the messages' contents together), refused before it is tokenized,"
        " on /tokenize too (0: 128 characters per token of the model's maximum length, more than any token holds)",
    )

    allowed_local_media_path: str = _opt(
        "", "directory whose image files chat requests may name (file: URLs or paths); empty: no local files"
    )
    allowed_media_domains: str = _opt(
        "", "comma-separated hosts whose http(s) image URLs the frontend fetches; empty: no URL is fetched"
    )
    limit_mm_per_prompt: str = _opt('{"image": 4}', "most images in one request, as JSON (vLLM's form)")
    max_image_pixels: int = _opt(4096 * 4096, "most pixels (width x height) of one image, read before decoding")
    max_image_bytes: int = _opt(10 * 2**20, "largest encoded image", parse=parse_bytes)

    def max_images(self) -> int:
        return int(json.loads(self.limit_mm_per_prompt).get("image", 0))

    def media_domains(self) -> tuple[str, ...]:
        return tuple(d.strip().lower() for d in self.allowed_media_domains.split(",") if d.strip())

    def validate(self) -> list[str]:
        errors = []
        try:
            if self.max_images() < 0:
                raise ValueError("negative")
        except (ValueError, TypeError, AttributeError):
            errors.append(f'--limit-mm-per-prompt is JSON like {{"image": 4}}, got {self.limit_mm_per_prompt!r}')
        if self.max_image_pixels <= 0 or self.max_image_bytes <= 0:
            errors.append("--max-image-pixels and --max-image-bytes must be > 0")
        if self.allowed_local_media_path and not os.path.isdir(self.allowed_local_media_path):
            errors.append(f"--allowed-local-media-path {self.allowed_local_media_path!r} is not a directory")
        if self.max_request_bytes <= 0:
            errors.append(f"--max-request-bytes must be > 0, got {self.max_request_bytes}")
        if self.max_prompt_chars < 0:
            errors.append(f"--max-prompt-chars must be >= 0 (0: from the model's length), got {self.max_prompt_chars}")
        return errors


@dataclass(slots=True)
class ResponsesConfig:
    """The Responses API's in-memory store of finished responses (``GET /v1/responses/{id}``,
    ``previous_response_id``), per frontend process."""

    max_stored_responses: int = _opt(
        1000, "finished /v1/responses answers a frontend keeps, the oldest dropped first past it (0: none kept)"
    )
    stored_response_max_age: float = _opt(3600.0, "seconds a stored /v1/responses answer is kept")

    def validate(self) -> list[str]:
        errors = []
        if self.max_stored_responses < 0:
            errors.append(f"--max-stored-responses must be >= 0 (0: none kept), got {self.max_stored_responses}")
        if not self.stored_response_max_age > 0:
            errors.append(f"--stored-response-max-age must be > 0, got {self.stored_response_max_age}")
        return errors


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
CHAT_TEMPLATES = (
    "hermes",
    "llama3_json",
    "mistral",
    "pythonic",
)  # shipped ones, in services/tokenizer/openai/tools/templates


@dataclass(slots=True)
class ChatConfig:
    """How the frontend renders chats and reads tool calls (vLLM's flag names)."""

    chat_template: str = _opt(
        "",
        "chat template for every chat: a Jinja file, or a shipped one by name ("
        + ", ".join(CHAT_TEMPLATES)
        + "); empty: the model's own, and for tools the tool-call parser's when the model's does not write tools",
    )
    tool_call_parser: str = _opt(
        "hermes", "format of the model's tool calls, read into OpenAI tool_calls", TOOL_CALL_PARSERS
    )
    trust_request_chat_template: bool = _opt(
        False,
        "accept a chat template in a chat request (chat_template), rendered in the same sandbox; a template can"
        " loop as long as it likes, so allow it only for trusted clients",
    )

    def validate(self) -> list[str]:
        if self.chat_template and self.chat_template not in CHAT_TEMPLATES and not os.path.isfile(self.chat_template):
            return [f"--chat-template {self.chat_template!r} is neither a file nor one of {', '.join(CHAT_TEMPLATES)}"]
        return []


def parse_lora_modules(text: str) -> dict[str, str]:
    """'a=/path/a b=/path/b' (spaces or commas between) -> {name: path}; raises ValueError."""
    modules: dict[str, str] = {}
    for item in text.replace(",", " ").split():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path items, got {item!r}")
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return modules


@dataclass(slots=True)
class LoraConfig:
    """LoRA adapters over the base model (vLLM's flag names); see docs/lora.md."""

    enable_lora: bool = _opt(False, "serve LoRA adapters: requests name one by the OpenAI model field or lora_name")
    lora_modules: str = _opt(
        "",
        "adapters served from the start, name=path items (PEFT directories), e.g. sql=/ad/sql chat=/ad/chat",
        many=True,
    )
    max_loras: int = _opt(1, "adapters on the device at once (the distinct adapters of one step), LRU beyond")
    max_lora_rank: int = _opt(16, "the largest adapter rank served")
    max_cpu_loras: int = _opt(0, "adapters kept in host memory, LRU beyond (0: as --max-loras)")
    allow_runtime_lora: bool = _opt(
        False, "accept POST /v1/load_lora_adapter and /v1/unload_lora_adapter (an API key if keys are set)"
    )

    def validate(self) -> list[str]:
        errors = []
        if self.max_loras < 1:
            errors.append(f"--max-loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            errors.append(f"--max-lora-rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras < 0:
            errors.append(f"--max-cpu-loras must be >= 0, got {self.max_cpu_loras}")
        try:
            modules = parse_lora_modules(self.lora_modules)
        except ValueError as exc:
            return [*errors, str(exc)]
        if (modules or self.allow_runtime_lora) and not self.enable_lora:
            errors.append("--lora-modules and --allow-runtime-lora need --enable-lora")
        return errors

    @property
    def modules(self) -> dict[str, str]:
        return parse_lora_modules(self.lora_modules)


ALL_SECTIONS = (
    ModelConfig,
    LoadConfig,
    DeviceConfig,
    CacheConfig,
    SchedulerConfig,
    ParallelConfig,
    RoutingConfig,
    LifecycleConfig,
    ObservabilityConfig,
    NetworkConfig,
    SecurityConfig,
    LimitsConfig,
    HttpConfig,
    ResponsesConfig,
    ChatConfig,
    LoraConfig,
)
# The sections each service takes its flags from (``kvgrid serve`` takes them all).
WORKER_SECTIONS = (
    ModelConfig,
    LoadConfig,
    DeviceConfig,
    CacheConfig,
    SchedulerConfig,
    ParallelConfig,
    LifecycleConfig,
    ObservabilityConfig,
    NetworkConfig,
    SecurityConfig,
    LoraConfig,
)
# `kvgrid worker-rank`: the rendezvous and the node; everything else comes from rank 0's plan.
WORKER_RANK_SECTIONS = (ParallelConfig, ObservabilityConfig)
SCHEDULER_SECTIONS = (
    ModelConfig,
    CacheConfig,
    SchedulerConfig,
    LifecycleConfig,
    ObservabilityConfig,
    NetworkConfig,
    SecurityConfig,
)
TOKENIZER_SECTIONS = (
    ModelConfig,
    SchedulerConfig,
    RoutingConfig,
    LifecycleConfig,
    ObservabilityConfig,
    NetworkConfig,
    SecurityConfig,
    LimitsConfig,
    HttpConfig,
    ResponsesConfig,
    ChatConfig,
    LoraConfig,
)
