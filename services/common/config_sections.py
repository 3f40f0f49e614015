"""The configuration sections: one dataclass per concern, one field per flag (``--kv-cache-memory``), each
also a ``KVGRID_*`` variable. ``config`` builds them from flags, the environment and these defaults."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field

from services.common.config_fields import flag_name, option, parse_bytes
from services.common.config_requests import (
    ChatConfig,
    HttpConfig,
    LimitsConfig,
    LoraConfig,
    ResponsesConfig,
)
from services.common.speculative import SpeculativeConfig, parse_speculative_config

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def model_name(model: str) -> str:
    """The served name for a --model value: the directory or file name without extension."""
    if not model:
        return DEFAULT_MODEL_NAME
    base = os.path.basename(os.path.normpath(model))
    return base[: -len(".gguf")] if base.lower().endswith(".gguf") else base


RUNNERS = ("generate", "pooling")
POOLING_TYPES = ("last", "mean", "cls")
TASKS = ("auto", "generate", "embed")


@dataclass(slots=True)
class ModelConfig:
    model: str = option("", "HF model directory, GGUF file, or empty for the embedded SmolLM2-135M-Instruct")
    served_model_name: str = option("", "name reported to clients (default: derived from --model)")
    tokenizer: str = option("", "tokenizer directory for the frontend (default: files sent by the worker)")
    dtype: str = option("auto", "weight and KV cache dtype", ("auto", "bfloat16", "float16", "float32"))
    max_model_len: int = option(0, "longest sequence in tokens (0: the model's own limit)")
    seed: int = option(0, "seed for requests that give none")
    runner: str = option(
        "generate",
        "what the worker runs the model as: generate (completions, chat) or pooling (embeddings: /v1/embeddings)",
        RUNNERS,
    )
    pooling_type: str = option(
        "last", "pooling runner: how a prompt's hidden states become one vector by default", POOLING_TYPES
    )
    normalize: bool = option(True, "pooling runner: scale vectors to unit L2 norm unless a request says otherwise")
    task: str = option("auto", "vLLM's older name for --runner: embed means pooling (auto: as --runner says)", TASKS)

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
    load_format: str = option("auto", "weight file format", ("auto", "safetensors", "gguf"))
    quantization: str = option(
        "none",
        "CPU weights: none (as loaded), int8 (per-channel, quantized at load) or gguf (a GGUF file's blocks)",
        ("none", "int8", "gguf"),
    )

    def validate(self) -> list[str]:
        return []


@dataclass(slots=True)
class DeviceConfig:
    device: str = option("auto", "where the worker runs the model (auto: cuda if available)", ("auto", "cpu", "cuda"))
    attention_backend: str = option(
        "auto", "attention implementation (auto: triton on CUDA, torch on CPU)", ("auto", "torch", "triton")
    )
    cpu_kernels: str = option(
        "auto",
        "CPU steps through native C kernels (auto: where a C compiler and AVX2 are present)",
        ("auto", "native", "torch"),
    )
    num_threads: int = option(0, "CPU threads for the worker's math (0: all cores, at most a container's CPU quota)")
    enforce_eager: bool = option(False, "no CUDA graphs: run every decode step eagerly (CUDA)")

    def validate(self) -> list[str]:
        return [f"--num-threads must be >= 0, got {self.num_threads}"] if self.num_threads < 0 else []


KV_TIERS = ("host", "redis")


@dataclass(slots=True)
class CacheConfig:
    block_size: int = option(16, "tokens per KV cache block")
    kv_cache_memory: int = option(
        0, "bytes for the KV cache on CPU, e.g. 2GiB (0: a safe share of free RAM)", parse=parse_bytes
    )
    gpu_memory_utilization: float = option(0.9, "fraction of GPU memory kvgrid may use (CUDA)")
    enable_prefix_caching: bool = option(True, "reuse KV blocks of identical prompt prefixes")
    kv_tiers: str = option(
        "", "KV tiers beyond the device pool, comma-separated: host (evicted blocks), redis (shared); empty: off"
    )
    kv_host_memory: int = option(4 * 2**30, "bytes of host memory for the host KV tier, e.g. 4GiB", parse=parse_bytes)
    kv_redis_url: str = option("", "Redis (or Valkey) server of the redis KV tier, e.g. redis://host:6379/0")

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
    max_num_seqs: int = option(128, "most requests running in one step")
    max_num_batched_tokens: int = option(2048, "most tokens computed in one step (the chunked-prefill budget)")
    max_waiting_requests: int = option(4096, "queue length past which Submit answers RESOURCE_EXHAUSTED")
    scheduling_policy: str = option("fcfs", "admission and preemption order", ("fcfs", "priority"))
    async_scheduling: bool = option(
        True, "plan each step while the worker runs the previous one (the worker feeds its sampled token forward)"
    )
    num_scheduler_steps: int = option(
        0,
        "decode steps one plan may stand for while every running request decodes and none waits"
        " (0: auto, as many as fit in 50 ms at the last decode step's time, at most 16)",
    )
    worker_reconnect_timeout: float = option(
        180.0, "seconds the requests of a lost worker wait for a worker to resume them before failing (UNAVAILABLE)"
    )
    speculative_config: str = option(
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
    tensor_parallel_size: int = option(
        1, "devices one worker shards the model over, one process each (must divide the attention and KV heads)"
    )

    pipeline_parallel_size: int = option(
        1,
        "pipeline stages: the layers split into this many contiguous ranges, each run by --tensor-parallel-size ranks",
    )
    distributed_init_method: str = option(
        "",
        "rendezvous of the ranks, tcp://HOST:PORT on rank 0's host (empty: MASTER_ADDR/MASTER_PORT when set,"
        " else a free local port)",
    )
    nnodes: int = option(
        1,
        "machines a worker group spreads over, equal shares of its ranks; node 0 runs rank 0, the others worker-rank",
    )
    node_rank: int = option(0, "this node's index (kvgrid worker-rank): it runs ranks node_rank*R..(node_rank+1)*R-1")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def validate(self) -> list[str]:
        errors = []
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                errors.append(f"--{flag_name(name)} must be >= 1, got {getattr(self, name)}")
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
    scheduler_resolve_interval: float = option(10.0, "seconds between DNS lookups of --scheduler-addrs names (0: once)")
    routing_policy: str = option(
        "cache-aware",
        "how the frontend picks a group: by prefix-cache overlap and load, or in turn",
        ("cache-aware", "round-robin"),
    )
    routing_prefix_weight: float = option(1.0, "score per fraction of the prompt a group holds in its prefix cache")
    routing_load_weight: float = option(
        0.5, "score taken off a group per running+waiting request, relative to the busiest group's"
    )
    routing_kv_weight: float = option(0.2, "score taken off a group per fraction of its KV cache in use")
    routing_balance_abs_threshold: int = option(
        8, "load alone decides when the busiest group has more than this many requests over the idlest ..."
    )
    routing_balance_rel_threshold: float = option(1.5, "... and more than this many times as many")

    def validate(self) -> list[str]:
        errors = []
        if self.scheduler_resolve_interval < 0:
            errors.append(f"--scheduler-resolve-interval must be >= 0, got {self.scheduler_resolve_interval}")
        if self.routing_balance_abs_threshold < 0 or self.routing_balance_rel_threshold < 1:
            errors.append("--routing-balance-abs-threshold must be >= 0 and --routing-balance-rel-threshold >= 1")
        return errors


@dataclass(slots=True)
class LifecycleConfig:
    shutdown_grace: float = option(
        30.0, "seconds in-flight requests may take to finish after SIGTERM; new ones get UNAVAILABLE meanwhile"
    )

    def validate(self) -> list[str]:
        return [f"--shutdown-grace must be >= 0, got {self.shutdown_grace}"] if self.shutdown_grace < 0 else []


@dataclass(slots=True)
class ObservabilityConfig:
    log_level: str = option("info", "log level", ("debug", "info", "warning", "error"))
    log_format: str = option("text", "log line format", ("text", "json"))

    def validate(self) -> list[str]:
        return []


@dataclass(slots=True)
class NetworkConfig:
    host: str = option("0.0.0.0", "address the servers bind to")
    tokenizer_port: int = option(50051, "tokenizer frontend gRPC port (public API)")
    http_port: int = option(8000, "tokenizer frontend HTTP port (OpenAI-compatible /v1, /metrics, /health)")
    scheduler_port: int = option(50052, "scheduler gRPC port")
    scheduler_metrics_port: int = option(8002, "scheduler /metrics port")
    worker_port: int = option(50053, "worker gRPC port")
    worker_metrics_port: int = option(8003, "worker /metrics port")
    scheduler_addr: str = option("localhost:50052", "where the tokenizer frontend reaches the scheduler")
    scheduler_addrs: str = option(
        "",
        "the schedulers of all worker groups, HOST:PORT,... or one DNS name resolving to many (a Kubernetes "
        "headless Service); empty: the one --scheduler-addr",
    )
    worker_addr: str = option("localhost:50053", "where the scheduler reaches the worker")

    def validate(self) -> list[str]:
        errors = []
        for f in dataclasses.fields(self):
            if f.name.endswith("_port") and not 0 <= getattr(self, f.name) <= 65535:
                errors.append(f"--{flag_name(f.name)} must be a port number, got {getattr(self, f.name)}")
        for name in ("scheduler_addr", "worker_addr"):
            if ":" not in getattr(self, name):
                errors.append(f"--{flag_name(name)} must be HOST:PORT, got {getattr(self, name)!r}")
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
    api_key_file: str = option("", "file with one API key per line (e.g. a mounted Secret), added to --api-key")
    metrics_require_key: bool = option(False, "the frontend's /metrics asks for an API key too")
    tls_cert_file: str = option("", "certificate (PEM) of the public ports, HTTP and gRPC; empty: plaintext")
    tls_key_file: str = option("", "private key (PEM) of --tls-cert-file")
    tls_ca_file: str = option("", "CA (PEM) client certificates of the public ports must chain to; empty: none asked")
    internal_tls_ca: str = option("", "CA (PEM) every service's certificate chains to; set the three for mutual TLS")
    internal_tls_cert: str = option("", "this service's certificate (PEM) toward the other services")
    internal_tls_key: str = option("", "private key (PEM) of --internal-tls-cert")

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
