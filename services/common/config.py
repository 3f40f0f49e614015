"""Typed configuration: plain dataclasses built from flags and ``KVGRID_*`` variables.

Every field of every section is a command-line flag (``--kv-cache-memory``) and an
environment variable (``KVGRID_KV_CACHE_MEMORY``). Precedence: flag, then variable,
then the default. Each service parses only the sections it needs; ``kvgrid serve``
parses all of them and hands each service its own flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

ENV_PREFIX = "KVGRID_"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ConfigError(ValueError):
    """One or more bad configuration values; the message has one line per problem."""


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None, parse=None):
    return field(default=default, metadata={"help": help, "choices": choices, "parse": parse})


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


@dataclass(slots=True)
class ModelConfig:
    model: str = _opt("", "HF model directory, GGUF file, or empty for the embedded SmolLM2-135M-Instruct")
    served_model_name: str = _opt("", "name reported to clients (default: derived from --model)")
    tokenizer: str = _opt("", "tokenizer directory for the frontend (default: files sent by the worker)")
    dtype: str = _opt("auto", "weight and KV cache dtype", ("auto", "bfloat16", "float16", "float32"))
    max_model_len: int = _opt(0, "longest sequence in tokens (0: the model's own limit)")
    seed: int = _opt(0, "seed for requests that give none")

    def validate(self) -> list[str]:
        errors = []
        if self.max_model_len < 0:
            errors.append(f"--max-model-len must be >= 0, got {self.max_model_len}")
        return errors

    @property
    def name(self) -> str:
        return self.served_model_name or model_name(self.model)


@dataclass(slots=True)
class LoadConfig:
    load_format: str = _opt("auto", "weight file format", ("auto", "safetensors", "gguf"))
    quantization: str = _opt(
        "none",
        "CPU weights: none (as loaded), int8 (per-channel, quantized at load) or gguf (a GGUF file's q4/q8 blocks)",
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
        return errors


@dataclass(slots=True)
class ParallelConfig:
    tensor_parallel_size: int = _opt(
        1, "devices one worker shards the model over, one process each (must divide the attention and KV heads)"
    )

    def validate(self) -> list[str]:
        if self.tensor_parallel_size < 1:
            return [f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}"]
        return []


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
)
SCHEDULER_SECTIONS = (ModelConfig, CacheConfig, SchedulerConfig, LifecycleConfig, ObservabilityConfig, NetworkConfig)
TOKENIZER_SECTIONS = (ModelConfig, SchedulerConfig, RoutingConfig, LifecycleConfig, ObservabilityConfig, NetworkConfig)


def model_name(model: str) -> str:
    """The served name for a --model value: the directory or file name without extension."""
    if not model:
        return DEFAULT_MODEL_NAME
    base = os.path.basename(os.path.normpath(model))
    return base[: -len(".gguf")] if base.lower().endswith(".gguf") else base


def _flag(name: str) -> str:
    return name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _parse_value(f: dataclasses.Field, text: str) -> Any:
    if f.metadata.get("parse"):
        return f.metadata["parse"](text)
    if f.type in ("bool", bool):
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {text!r}")
    if f.type in ("int", int):
        return int(text)
    if f.type in ("float", float):
        return float(text)
    return text


def add_arguments(parser: argparse.ArgumentParser, sections=ALL_SECTIONS) -> None:
    """Add one flag per field of each section; defaults come later, from the environment."""
    for section in sections:
        group = parser.add_argument_group(section.__name__.removesuffix("Config").lower())
        for f in dataclasses.fields(section):
            flag = "--" + _flag(f.name)
            text = f"{f.metadata['help']} [env {env_name(f.name)}, default {f.default!r}]"
            if f.type in ("bool", bool):
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=text)
            else:
                group.add_argument(
                    flag,
                    dest=f.name,
                    default=None,
                    metavar=f.name.upper(),
                    choices=f.metadata.get("choices"),
                    help=text,
                )


def build_section(section, args: argparse.Namespace | None = None, environ=None):
    """One section from parsed flags (strings), the environment and defaults; raises ConfigError."""
    environ = os.environ if environ is None else environ
    values, errors = {}, []
    for f in dataclasses.fields(section):
        raw = getattr(args, f.name, None) if args is not None else None
        source = "--" + _flag(f.name)
        if raw is None and env_name(f.name) in environ:
            raw, source = environ[env_name(f.name)], env_name(f.name)
        if raw is None:
            continue
        if isinstance(raw, bool):
            values[f.name] = raw
            continue
        choices = f.metadata.get("choices")
        if choices and raw not in choices:
            errors.append(f"{source} must be one of {', '.join(choices)}, got {raw!r}")
            continue
        try:
            values[f.name] = _parse_value(f, raw)
        except ValueError as e:
            errors.append(f"{source}: {e}")
    if errors:
        raise ConfigError("\n".join(errors))
    config = section(**values)
    errors = config.validate()
    if errors:
        raise ConfigError("\n".join(errors))
    return config


@dataclass(slots=True)
class Config:
    """The sections a command parsed; the others stay None."""

    model: ModelConfig | None = None
    load: LoadConfig | None = None
    device: DeviceConfig | None = None
    cache: CacheConfig | None = None
    scheduler: SchedulerConfig | None = None
    parallel: ParallelConfig | None = None
    routing: RoutingConfig | None = None
    lifecycle: LifecycleConfig | None = None
    observability: ObservabilityConfig | None = None
    network: NetworkConfig | None = None


def _attr(section) -> str:
    return section.__name__.removesuffix("Config").lower()


def build_config(sections=ALL_SECTIONS, args: argparse.Namespace | None = None, environ=None) -> Config:
    """The requested sections from flags, environment and defaults, reporting every problem at once."""
    config, errors = Config(), []
    for section in sections:
        try:
            setattr(config, _attr(section), build_section(section, args, environ))
        except ConfigError as e:
            errors.append(str(e))
    if errors:
        raise ConfigError("\n".join(errors))
    return config


def to_flags(config) -> list[str]:
    """A section back into command-line flags (used by `kvgrid serve` to start each service)."""
    flags = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.type in ("bool", bool):
            flags.append(("--" if value else "--no-") + _flag(f.name))
        else:
            flags += ["--" + _flag(f.name), str(value)]
    return flags
