"""Checks on every public request field; each failure is INVALID_ARGUMENT naming the field.

Nothing invalid reaches the scheduler. proto3 zeros mean "the default" (see
common.proto), so only values a client must have chosen on purpose are rejected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvgrid.v1 import common_pb2
from services.common.errors import InvalidArgument
from services.tokenizer.grammar_check import GrammarChecker

DEFAULT_MAX_TOKENS = 16
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_REQUEST_ID_CHARS = 256
MAX_CHAT_MESSAGES = 4096
CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(slots=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int
    # Structured-output specs are compiled against the served vocabulary (a bare checker reads syntax only).
    grammars: GrammarChecker = field(default_factory=GrammarChecker)


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


def check_sampling(sampling: common_pb2.SamplingParams, limits: ModelLimits) -> None:
    s = sampling
    _in_range("sampling.temperature", s.temperature, 0.0, MAX_TEMPERATURE)
    _in_range("sampling.top_p", s.top_p, 0.0, 1.0)  # 0 means 1
    if not -1 <= s.top_k <= limits.vocab_size:
        raise InvalidArgument("sampling.top_k", f"must be -1, 0 (no cut) or up to {limits.vocab_size}, got {s.top_k}")
    _in_range("sampling.min_p", s.min_p, 0.0, 1.0)
    _in_range("sampling.presence_penalty", s.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
    _in_range("sampling.frequency_penalty", s.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
    _finite("sampling.repetition_penalty", s.repetition_penalty)
    if s.repetition_penalty < 0:
        raise InvalidArgument("sampling.repetition_penalty", f"must be > 0 (0 means 1), got {s.repetition_penalty:g}")
    if s.logprobs > MAX_LOGPROBS:
        raise InvalidArgument("sampling.logprobs", f"at most {MAX_LOGPROBS}, got {s.logprobs}")
    if s.max_tokens > limits.max_model_len:
        raise InvalidArgument(
            "sampling.max_tokens", f"{s.max_tokens} exceeds the model's maximum length of {limits.max_model_len} tokens"
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
    check_token_ids("sampling.stop_token_ids", s.stop_token_ids, limits.vocab_size)
    check_structured_output(s, limits)


def check_structured_output(s: common_pb2.SamplingParams, limits: ModelLimits) -> None:
    kind = s.WhichOneof("structured_output")
    if kind is None:
        return
    # A complete output allows only EOS: the request must be free to end on it.
    if s.ignore_eos:
        raise InvalidArgument("sampling.ignore_eos", f"cannot be combined with a structured output ({kind})")
    if s.min_tokens:
        raise InvalidArgument("sampling.min_tokens", f"cannot be combined with a structured output ({kind})")
    where, problem = limits.grammars.problem(s)
    if problem:
        raise InvalidArgument(where, problem)


def check_prompt_length(field: str, num_prompt_tokens: int, limits: ModelLimits) -> None:
    if num_prompt_tokens == 0:
        raise InvalidArgument(field, "the prompt has no tokens")
    if num_prompt_tokens >= limits.max_model_len:
        raise InvalidArgument(
            field,
            f"the prompt has {num_prompt_tokens} tokens but the model allows at most {limits.max_model_len} "
            f"tokens in all (prompt + output), so a prompt must be shorter than {limits.max_model_len}",
        )


def check_messages(field: str, messages) -> None:
    if not messages:
        raise InvalidArgument(field, "must contain at least one message")
    if len(messages) > MAX_CHAT_MESSAGES:
        raise InvalidArgument(field, f"at most {MAX_CHAT_MESSAGES} messages, got {len(messages)}")
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"{field}[{i}].role", f"unknown role {message.role!r} (use one of {', '.join(CHAT_ROLES)})"
            )
