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
from dataclasses import dataclass
from typing import Any

from services.common.config_fields import flag_name, parse_bytes  # noqa: F401 - parse_bytes: this module's API
from services.common.config_requests import (  # noqa: F401 - the sections are part of this module's API
    ChatConfig,
    HttpConfig,
    LimitsConfig,
    LoraConfig,
    ResponsesConfig,
)
from services.common.config_sections import (  # noqa: F401 - the sections are part of this module's API
    ALL_SECTIONS,
    DEFAULT_MODEL_NAME,
    KV_TIERS,
    SCHEDULER_SECTIONS,
    TOKENIZER_SECTIONS,
    WORKER_RANK_SECTIONS,
    WORKER_SECTIONS,
    CacheConfig,
    DeviceConfig,
    LifecycleConfig,
    LoadConfig,
    ModelConfig,
    NetworkConfig,
    ObservabilityConfig,
    ParallelConfig,
    RoutingConfig,
    SchedulerConfig,
    SecurityConfig,
    model_name,
)

ENV_PREFIX = "KVGRID_"


class ConfigError(ValueError):
    """One or more bad configuration values; the message has one line per problem."""


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
            flag = "--" + flag_name(f.name)
            text = f"{f.metadata['help']} [env {env_name(f.name)}, default {f.default!r}]"
            if f.type in ("bool", bool):
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=text)
            else:
                group.add_argument(
                    flag,
                    dest=f.name,
                    default=None,
                    nargs="+" if f.metadata.get("many") else None,
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
        source = "--" + flag_name(f.name)
        if raw is None and env_name(f.name) in environ:
            raw, source = environ[env_name(f.name)], env_name(f.name)
        if raw is None:
            continue
        if isinstance(raw, bool):
            values[f.name] = raw
            continue
        if isinstance(raw, list):  # a flag of several values (see config_fields.option's many)
            raw = " ".join(raw)
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
    security: SecurityConfig | None = None
    limits: LimitsConfig | None = None
    http: HttpConfig | None = None
    responses: ResponsesConfig | None = None
    chat: ChatConfig | None = None
    lora: LoraConfig | None = None


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
            flags.append(("--" if value else "--no-") + flag_name(f.name))
        else:
            flags += ["--" + flag_name(f.name), str(value)]
    return flags
