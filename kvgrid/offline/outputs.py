"""What ``LLM.generate`` returns, assembled by the frontend's own output processor.

The scheduler's sampled tokens go through ``services.tokenizer.output.OutputProcessor``
exactly as in the served stack: incremental detokenization, stop strings (the text ends
before the stop string; tokens after the one that completed it are dropped), min_tokens,
and logprobs named with their token text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvgrid.v1 import common_pb2, scheduler_pb2
from services.scheduler.convert import add_output
from services.scheduler.scheduler import RequestOutput as SampledToken
from services.tokenizer.output import OutputProcessor
from services.tokenizer.text_tokenizer import TextTokenizer


@dataclass(slots=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(slots=True)
class TokenLogprob:
    """The sampled token's log-probability under the raw model distribution, and the best alternatives."""

    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob]

    @classmethod
    def from_proto(cls, msg: common_pb2.TokenLogprob) -> TokenLogprob:
        top = [TopLogprob(t.token_id, t.token, t.logprob) for t in msg.top]
        return cls(msg.token_id, msg.token, msg.logprob, top)


@dataclass(slots=True)
class RequestOutput:
    """One finished request."""

    request_id: str
    prompt: str | None  # None when the prompt was given as token ids or as chat messages
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprob] | None  # one per token id when SamplingParams.logprobs > 0


class OutputCollector:
    """One request's tokens in, its ``RequestOutput`` once finished."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        request_id: str,
        prompt: str | None,
        prompt_ids: Sequence[int],
        sampling: common_pb2.SamplingParams,
    ):
        self._processor = OutputProcessor(tokenizer, request_id, prompt_ids, sampling)
        self._prompt = prompt
        self._prompt_ids = list(prompt_ids)
        self._want_logprobs = sampling.logprobs > 0
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []

    @property
    def finished(self) -> bool:
        return self._processor.finished

    def push(self, sampled: SampledToken) -> None:
        delta = scheduler_pb2.SubmitResponse(num_prompt_tokens=len(self._prompt_ids))
        add_output(delta, sampled)
        if sampled.request.num_cached_tokens >= 0:
            delta.num_cached_tokens = sampled.request.num_cached_tokens
        out = self._processor.process(delta)
        if out is None:
            return
        self._text.append(out.text)
        self._token_ids.extend(out.token_ids)
        self._logprobs.extend(TokenLogprob.from_proto(lp) for lp in out.logprobs)

    def result(self) -> RequestOutput:
        p = self._processor
        return RequestOutput(
            request_id=p.request_id,
            prompt=self._prompt,
            prompt_token_ids=self._prompt_ids,
            text="".join(self._text),
            token_ids=self._token_ids,
            finish_reason=p.finish_reason,
            num_prompt_tokens=p.num_prompt_tokens,
            num_completion_tokens=p.num_output_tokens,
            num_cached_tokens=p.num_cached_tokens,
            logprobs=self._logprobs if self._want_logprobs else None,
        )
