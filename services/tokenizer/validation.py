"""Checks on every public request field; each failure is INVALID_ARGUMENT naming the field.

The field ranges are ``services.common.request_checks``, which the scheduler applies too; here are the
checks that need the tokenizer or the served vocabulary. Nothing invalid reaches the scheduler. proto3 zeros
mean "the default" (see common.proto), so only values a client must have chosen on purpose are rejected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvgrid.v1 import common_pb2
from services.common.errors import InvalidArgument
from services.common.request_checks import (  # noqa: F401 - the frontend's checks are these too
    DEFAULT_MAX_TOKENS,
    MAX_LOGPROBS,
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    check_request_id,
    check_sampling_fields,
    check_token_ids,
)
from services.tokenizer.grammar_check import GrammarChecker

MAX_CHAT_MESSAGES = 4096
CHAT_ROLES = ("system", "user", "assistant", "tool")
# No token of a real vocabulary is longer than this many characters (SmolLM2's longest, a newline and 80 spaces,
# is 81; its densest runs of spaces, '-', '=' or '#' give 64 characters a token), so a prompt of more than this
# many characters per token the model allows cannot fit and is refused before it is tokenized.
MAX_CHARS_PER_TOKEN = 128
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(slots=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int
    # Structured-output specs are compiled against the served vocabulary (a bare checker reads syntax only).
    grammars: GrammarChecker = field(default_factory=GrammarChecker)
    # The longest prompt in characters (chat: the messages' contents together); 0 means
    # MAX_CHARS_PER_TOKEN characters for each token of max_model_len.
    max_prompt_chars: int = 0

    def __post_init__(self) -> None:
        if self.max_prompt_chars <= 0:
            self.max_prompt_chars = MAX_CHARS_PER_TOKEN * self.max_model_len


def check_sampling(sampling: common_pb2.SamplingParams, limits: ModelLimits) -> None:
    """The scheduler's checks of every field (``request_checks``), then the structured-output spec compiled
    against the served vocabulary, which only the frontend can do."""
    check_sampling_fields(sampling, limits.max_model_len, limits.vocab_size)
    if sampling.WhichOneof("structured_output") is not None:
        where, problem = limits.grammars.problem(sampling)
        if problem:
            raise InvalidArgument(where, problem)


def check_prompt_chars(field: str, num_chars: int, max_chars: int) -> None:
    """Before tokenizing: a prompt this long costs the frontend seconds and cannot fit the model anyway."""
    if num_chars > max_chars:
        raise InvalidArgument(
            field, f"the prompt has {num_chars} characters; at most {max_chars} are accepted (--max-prompt-chars)"
        )


def lone_surrogate(text: str) -> int:
    """The index of the first lone surrogate (U+D800..U+DFFF) in ``text``, or -1. JSON can carry one
    ("\\ud800"); it is not a character and no UTF-8 encoder, tokenizer or protobuf string takes it."""
    if text.isascii():
        return -1
    match = _SURROGATE.search(text)
    return -1 if match is None else match.start()


def check_text(field: str, text: str) -> None:
    where = lone_surrogate(text)
    if where >= 0:
        raise InvalidArgument(field, f"is not valid Unicode: a lone surrogate at character {where}")


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
