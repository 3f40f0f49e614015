"""An OpenAI request's fields as the gRPC API's SamplingParams, and the request's name for each of its fields.

The gRPC checks name ``sampling.<field>``; ``public_field`` turns that into the name the HTTP client used
(``temperature``, ``top_logprobs``, ``response_format.json_schema.schema``, ``stop[1]``...).
"""

from __future__ import annotations

import json
import re

from kvgrid.v1 import common_pb2
from services.common.errors import InvalidArgument
from services.tokenizer.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from services.tokenizer.validation import DEFAULT_MAX_TOKENS, ModelLimits

OPENAI_TEMPERATURE = 1.0  # OpenAI samples unless told otherwise
_FIELD = re.compile(r"sampling\.([a-z_]+)(.*)")


class SamplingFields:
    """The SamplingParams of one request and, per proto field, the request's own name for it."""

    def __init__(self, params: common_pb2.SamplingParams, names: dict[str, str]):
        self.params = params
        self.names = names

    def public_field(self, field: str) -> str:
        match = _FIELD.fullmatch(field)
        if match is None:
            return field
        return self.names.get(match[1], match[1]) + match[2]


def completion_sampling(req: CompletionRequest) -> SamplingFields:
    s, names = _common(req)
    s.max_tokens = req.max_tokens or DEFAULT_MAX_TOKENS
    if req.logprobs is not None:
        s.logprobs = max(req.logprobs, 1)  # 0 asks for the sampled token's logprob alone
        if req.echo:  # the echoed prompt's tokens lead the logprobs
            s.prompt_logprobs = max(req.logprobs, req.prompt_logprobs or 0)
            names["prompt_logprobs"] = "prompt_logprobs" if s.prompt_logprobs > req.logprobs else "logprobs"
    return SamplingFields(s, names)


def chat_sampling(req: ChatCompletionRequest, limits: ModelLimits) -> SamplingFields:
    s, names = _common(req)
    if req.max_completion_tokens is not None:
        s.max_tokens, names["max_tokens"] = req.max_completion_tokens, "max_completion_tokens"
    else:  # chat runs to the end of the model's length unless told (capped to what the prompt leaves)
        s.max_tokens = req.max_tokens or limits.max_model_len
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidArgument("top_logprobs", "needs logprobs set to true")
    if req.logprobs:
        s.logprobs = max(req.top_logprobs or 0, 1)
        names["logprobs"] = "top_logprobs"
    return SamplingFields(s, names)


def num_top_logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many alternatives each returned token lists; None when no logprobs were asked for."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    return (req.top_logprobs or 0) if req.logprobs else None


def _common(req: SamplingRequest) -> tuple[common_pb2.SamplingParams, dict[str, str]]:
    s = common_pb2.SamplingParams(
        temperature=OPENAI_TEMPERATURE if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty or 0.0,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        stop_token_ids=req.stop_token_ids or [],
        include_special_tokens=not req.skip_special_tokens,
    )
    if req.seed is not None:
        s.seed = req.seed
    if req.prompt_logprobs is not None:
        if req.stream:
            raise InvalidArgument("prompt_logprobs", "not available with stream: true")
        s.prompt_logprobs = req.prompt_logprobs
    if req.stop is not None:
        s.stop.extend([req.stop] if isinstance(req.stop, str) else req.stop)
    names: dict[str, str] = {}
    _structured(req, s, names)
    return s, names


def _structured(req: SamplingRequest, s: common_pb2.SamplingParams, names: dict[str, str]) -> None:
    fmt, extra = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text" and extra is not None:
        raise InvalidArgument("structured_outputs", "set either response_format or structured_outputs, not both")
    if fmt is not None and fmt.type == "json_object":
        s.json_object, names["json_object"] = True, "response_format"
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidArgument("response_format.json_schema", "needs a schema")
        s.json_schema = json.dumps(fmt.json_schema.schema_)
        names["json_schema"] = "response_format.json_schema.schema"
    if extra is None:
        return
    given = {k: v for k, v in extra.model_dump(by_alias=True).items() if v is not None}
    if len(given) != 1:
        raise InvalidArgument(
            "structured_outputs",
            f"set exactly one of json, regex, choice, grammar, json_object, got {sorted(given) or 'none'}",
        )
    key, value = next(iter(given.items()))
    if key == "json":
        s.json_schema = value if isinstance(value, str) else json.dumps(value)
        names["json_schema"] = "structured_outputs.json"
    elif key == "choice":
        s.choice.choices.extend(value)
        names["choice"] = "structured_outputs.choice"
    else:
        setattr(s, key, value)
        names[key] = f"structured_outputs.{key}"
