"""``SamplingParams`` for offline use: the kvgrid.v1 message's fields and defaults, checked by the frontend's rules.

Range checks run when the object is built; the checks that depend on the model (``top_k`` against the
vocabulary, ``max_tokens`` against the model length, stop token ids) run again when a request uses it.
Every failure is a ``ValueError`` with the frontend's message (``sampling.top_p: must be in [0, 1], got 1.5``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from kvgrid.v1 import common_pb2
from services.common.errors import InvalidArgument
from services.tokenizer.validation import DEFAULT_MAX_TOKENS, ModelLimits, check_sampling

# Before a model is known: every range check applies, none of the model-dependent limits bites.
_NO_MODEL = ModelLimits(max_model_len=2**32, vocab_size=2**31 - 1)
_UNSIGNED = ("max_tokens", "min_tokens", "logprobs")


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens; see ``protos/kvgrid/v1/common.proto`` for each field's meaning."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no cut
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int = 0  # top alternatives returned per sampled token (0: no logprobs)
    include_special_tokens: bool = False
    # vLLM's prompt_logprobs: top alternatives returned per prompt token (0: the token alone; None: no prompt logprobs)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate(_NO_MODEL)

    def to_proto(self) -> common_pb2.SamplingParams:
        for name in _UNSIGNED:
            if getattr(self, name) < 0:
                raise ValueError(f"sampling.{name}: must be >= 0, got {getattr(self, name)}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"sampling.prompt_logprobs: must be >= 0 or None, got {self.prompt_logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"sampling.seed: must be in [0, 2**64), got {self.seed}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"sampling.stop_token_ids: token ids are >= 0, got {list(self.stop_token_ids)}")
        msg = common_pb2.SamplingParams()
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue  # seed, prompt_logprobs: unset
            try:
                if isinstance(value, list | tuple):
                    getattr(msg, f.name).extend(value)
                else:
                    setattr(msg, f.name, value)
            except (TypeError, ValueError) as e:
                raise TypeError(f"sampling.{f.name}: {e} (got {value!r})") from None
        return msg

    def validate(self, limits: ModelLimits) -> common_pb2.SamplingParams:
        """The message for these parameters; ValueError (the frontend's message) where the model refuses them."""
        msg = self.to_proto()
        try:
            check_sampling(msg, limits)
        except InvalidArgument as e:
            raise ValueError(str(e)) from None
        return msg
