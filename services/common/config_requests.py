"""The configuration sections of what requests may ask the frontend for: its HTTP servers, each request's limits
(images among them), stored responses, chat templates and tool calls, LoRA adapters. Each field is a flag and a
``KVGRID_*`` variable, as in ``config_sections``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from services.common.config_fields import flag_name, option, parse_bytes


@dataclass(slots=True)
class HttpConfig:
    """The frontend's public servers: how many processes share its ports, and for HTTP how long a connection may
    idle or take over its headers, and how many it holds."""

    api_server_count: int = option(
        1,
        "frontend processes sharing the public gRPC and HTTP ports (SO_REUSEPORT), each with its own link to the "
        "schedulers: `kvgrid serve` starts this many; a `kvgrid tokenizer` given more than 1 joins such a group",
    )

    http_keep_alive_timeout: float = option(5.0, "seconds an idle keep-alive HTTP connection stays open")
    http_header_timeout: float = option(
        10.0,
        "seconds a client has to send a request's headers, from the connection's start or the request's first byte",
    )
    http_max_connections: int = option(
        1024, "HTTP connections and requests served at once; past it requests get 503 (0: no limit)"
    )
    http_max_header_bytes: int = option(
        16 * 2**10, "largest HTTP request line and headers; bigger ones get 400", parse=parse_bytes
    )

    def validate(self) -> list[str]:
        errors = []
        if self.api_server_count < 1:
            errors.append(f"--api-server-count must be >= 1, got {self.api_server_count}")
        for name in ("http_keep_alive_timeout", "http_header_timeout"):
            if not getattr(self, name) > 0:
                errors.append(f"--{flag_name(name)} must be > 0, got {getattr(self, name)}")
        if self.http_max_connections < 0:
            errors.append(f"--http-max-connections must be >= 0 (0: no limit), got {self.http_max_connections}")
        if self.http_max_header_bytes < 1024:
            errors.append(f"--http-max-header-bytes must be >= 1024, got {self.http_max_header_bytes}")
        return errors


@dataclass(slots=True)
class LimitsConfig:
    """What one request may cost the frontend, so that no request can stall the others."""

    max_request_bytes: int = option(
        16 * 2**20, "largest HTTP body or public gRPC message the frontend reads", parse=parse_bytes
    )
    max_prompt_chars: int = option(
        0,
        "longest prompt in characters (chat: the messages' contents together), refused before it is tokenized,"
        " on /tokenize too (0: 128 characters per token of the model's maximum length, more than any token holds)",
    )

    allowed_local_media_path: str = option(
        "", "directory whose image files chat requests may name (file: URLs or paths); empty: no local files"
    )
    allowed_media_domains: str = option(
        "", "comma-separated hosts whose http(s) image URLs the frontend fetches; empty: no URL is fetched"
    )
    limit_mm_per_prompt: str = option('{"image": 4}', "most images in one request, as JSON (vLLM's form)")
    max_image_pixels: int = option(4096 * 4096, "most pixels (width x height) of one image, read before decoding")
    max_image_bytes: int = option(10 * 2**20, "largest encoded image", parse=parse_bytes)

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

    max_stored_responses: int = option(
        1000, "finished /v1/responses answers a frontend keeps, the oldest dropped first past it (0: none kept)"
    )
    stored_response_max_age: float = option(3600.0, "seconds a stored /v1/responses answer is kept")

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

    chat_template: str = option(
        "",
        "chat template for every chat: a Jinja file, or a shipped one by name ("
        + ", ".join(CHAT_TEMPLATES)
        + "); empty: the model's own, and for tools the tool-call parser's when the model's does not write tools",
    )
    tool_call_parser: str = option(
        "hermes", "format of the model's tool calls, read into OpenAI tool_calls", TOOL_CALL_PARSERS
    )
    trust_request_chat_template: bool = option(
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

    enable_lora: bool = option(False, "serve LoRA adapters: requests name one by the OpenAI model field or lora_name")
    lora_modules: str = option(
        "",
        "adapters served from the start, name=path items (PEFT directories), e.g. sql=/ad/sql chat=/ad/chat",
        many=True,
    )
    max_loras: int = option(1, "adapters on the device at once (the distinct adapters of one step), LRU beyond")
    max_lora_rank: int = option(16, "the largest adapter rank served")
    max_cpu_loras: int = option(0, "adapters kept in host memory, LRU beyond (0: as --max-loras)")
    allow_runtime_lora: bool = option(
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
