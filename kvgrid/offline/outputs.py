"""What ``LLM.generate`` returns, assembled by the frontend's own output processor.

The scheduler's sampled tokens go through ``services.tokenizer.output.OutputProcessor``
exactly as in the served stack: incremental detokenization, stop strings (the text ends
before the stop string; tokens after the one that completed it are dropped), min_tokens,
and logprobs named with their token text.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgrid.offline.tool_calls import parsed_calls
from kvgrid.v1 import common_pb2, generate_pb2, scheduler_pb2
from services.scheduler.convert import add_output
from services.scheduler.step_plan import RequestOutput as SampledToken
from services.tokenizer.frontdoor import EngineRequest
from services.tokenizer.output import OutputProcessor, merge
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
class Logprob:
    """vLLM's Logprob: one token's log-probability at a position, its rank there (1: the most likely), its text."""

    logprob: float
    rank: int
    decoded_token: str


# Per prompt position: token id -> Logprob, for the prompt's own token and the top alternatives; None at position 0.
PromptLogprobs = list[dict[int, Logprob] | None]


def prompt_logprobs_from_proto(entries) -> PromptLogprobs:
    """vLLM's shape of ``RequestOutput.prompt_logprobs`` from the PromptLogprob messages of positions 1, 2, ..."""
    out: PromptLogprobs = [None]
    for entry in entries:
        position = {t.token_id: Logprob(t.logprob, rank, t.token) for rank, t in enumerate(entry.top, 1)}
        position[entry.token_id] = Logprob(entry.logprob, entry.rank, entry.token)
        out.append(position)
    return out


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
    # With SamplingParams.prompt_logprobs: one entry per prompt token (vLLM's shape, None first), else None.
    prompt_logprobs: PromptLogprobs | None = None
    # chat with tools: the calls the model made (OpenAI's shape); None when no tools were active
    tool_calls: list[dict] | None = None


class OutputCollector:
    """One request's sampled tokens in, through the frontend's output path; its whole response once finished."""

    def __init__(self, tokenizer: TextTokenizer, request_id: str, request: EngineRequest):
        self._processor = OutputProcessor(tokenizer, request_id, request.prompt_ids, request.sampling)
        self._num_prompt_tokens = len(request.prompt_ids)
        self.response: generate_pb2.GenerateResponse | None = None

    @property
    def finished(self) -> bool:
        return self._processor.finished

    def push(self, sampled: SampledToken) -> None:
        delta = scheduler_pb2.SubmitResponse(num_prompt_tokens=self._num_prompt_tokens)
        add_output(delta, sampled)
        if sampled.request.num_cached_tokens >= 0:
            delta.num_cached_tokens = sampled.request.num_cached_tokens
        self.response = merge([self.response, self._processor.process(delta)])


def request_output(request: EngineRequest, response: generate_pb2.GenerateResponse) -> RequestOutput:
    """The public ``RequestOutput`` of one finished request."""
    usage = response.usage
    text, calls = parsed_calls(request.tool_parser, response.text)
    return RequestOutput(
        request_id=response.request_id,
        prompt=request.prompt_text,
        prompt_token_ids=list(request.prompt_ids),
        text=text,
        token_ids=list(response.token_ids),
        finish_reason=response.finish_reason,
        num_prompt_tokens=usage.prompt_tokens,
        num_completion_tokens=usage.completion_tokens,
        num_cached_tokens=usage.cached_prompt_tokens,
        logprobs=[TokenLogprob.from_proto(lp) for lp in response.logprobs] if request.sampling.logprobs else None,
        prompt_logprobs=(
            prompt_logprobs_from_proto(response.prompt_logprobs)
            if request.sampling.HasField("prompt_logprobs")
            else None
        ),
        tool_calls=calls,
    )
