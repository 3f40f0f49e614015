"""The request checks the frontend and the scheduler both apply: sampling ranges, request ids, token ids.

Each failure is INVALID_ARGUMENT naming the field. The frontend (``services.tokenizer.validation``) adds what
needs a tokenizer (structured-output specs compiled against the vocabulary, chat messages, prompt text); the
scheduler applies these to every Submit, so a tool calling ``Scheduler.Submit`` directly gets the same answers
as a client of the public API. proto3 zeros mean "the default" (see common.proto).
"""

from __future__ import annotations

import math

from kvgrid.v1 import common_pb2
from services.common.errors import InvalidArgument

DEFAULT_MAX_TOKENS = 16
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_REQUEST_ID_CHARS = 256


def _finite(field: str, value: float) -> None:
    if not math.isfinite(value):
        raise InvalidArgument(field, f"must be a finite number, got {value}")


def _in_range(field: str, value: float, low: float, high: float) -> None:
    _finite(field, value)
    if not low <= value <= high:
        raise InvalidArgument(field, f"must be in [{low:g}, {high:g}], got {value:g}")


def check_token_ids(field: str, token_ids, vocab_size: int) -> None:
    for i, token_id in enumerate(token_ids):
        if token_id >= vocab_size:
            raise InvalidArgument(f"{field}[{i}]", f"token id {token_id} is outside the vocabulary (size {vocab_size})")


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")
    if not request_id.isprintable():
        raise InvalidArgument("request_id", "must contain printable characters only")


def check_sampling_fields(s: common_pb2.SamplingParams, max_model_len: int, vocab_size: int) -> None:
    """Every sampling field against its range and the served model's limits (not the structured-output spec,
    which only a tokenizer can check)."""
    _in_range("sampling.temperature", s.temperature, 0.0, MAX_TEMPERATURE)
    _in_range("sampling.top_p", s.top_p, 0.0, 1.0)  # 0 means 1
    if not -1 <= s.top_k <= vocab_size:
        raise InvalidArgument("sampling.top_k", f"must be -1, 0 (no cut) or up to {vocab_size}, got {s.top_k}")
    _in_range("sampling.min_p", s.min_p, 0.0, 1.0)
    _in_range("sampling.presence_penalty", s.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
    _in_range("sampling.frequency_penalty", s.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
    _finite("sampling.repetition_penalty", s.repetition_penalty)
    if s.repetition_penalty < 0:
        raise InvalidArgument("sampling.repetition_penalty", f"must be > 0 (0 means 1), got {s.repetition_penalty:g}")
    if s.logprobs > MAX_LOGPROBS:
        raise InvalidArgument("sampling.logprobs", f"at most {MAX_LOGPROBS}, got {s.logprobs}")
    if s.HasField("prompt_logprobs") and s.prompt_logprobs > MAX_LOGPROBS:
        raise InvalidArgument("sampling.prompt_logprobs", f"at most {MAX_LOGPROBS}, got {s.prompt_logprobs}")
    if s.max_tokens > max_model_len:
        raise InvalidArgument(
            "sampling.max_tokens", f"{s.max_tokens} exceeds the model's maximum length of {max_model_len} tokens"
        )
    max_tokens = s.max_tokens or DEFAULT_MAX_TOKENS
    if s.min_tokens > max_tokens:
        raise InvalidArgument("sampling.min_tokens", f"{s.min_tokens} is more than max_tokens ({max_tokens})")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(s.stop)}")
    for i, stop in enumerate(s.stop):
        if not stop:
            raise InvalidArgument(f"sampling.stop[{i}]", "must not be empty")
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidArgument(f"sampling.stop[{i}]", f"at most {MAX_STOP_STRING_CHARS} characters, got {len(stop)}")
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(
            "sampling.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(s.stop_token_ids)}"
        )
    check_token_ids("sampling.stop_token_ids", s.stop_token_ids, vocab_size)
    kind = s.WhichOneof("structured_output")
    # A complete structured output allows only EOS: the request must be free to end on it.
    if kind is not None and s.ignore_eos:
        raise InvalidArgument("sampling.ignore_eos", f"cannot be combined with a structured output ({kind})")
    if kind is not None and s.min_tokens:
        raise InvalidArgument("sampling.min_tokens", f"cannot be combined with a structured output ({kind})")
