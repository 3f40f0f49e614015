"""One request's output: the scheduler's token deltas in, public GenerateResponse deltas out.

Text goes through the incremental detokenizer, then the stop-string matcher; the
token ids and logprobs pass through as they arrive. The response that ends the
request (the scheduler's finish, or a stop string found here) carries
finish_reason and usage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from kvgrid.v1 import common_pb2, generate_pb2, scheduler_pb2
from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.stop_strings import StopStringMatcher
from services.tokenizer.text_tokenizer import TextTokenizer

_Logprob = TypeVar("_Logprob", common_pb2.TokenLogprob, common_pb2.PromptLogprob)

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


class OutputProcessor:
    def __init__(
        self,
        tokenizer: TextTokenizer,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: common_pb2.SamplingParams,
    ):
        self._tokenizer = tokenizer
        self.request_id = request_id
        self._detokenizer = IncrementalDetokenizer(tokenizer, not sampling.include_special_tokens, prompt_ids)
        self._stops = StopStringMatcher(list(sampling.stop))
        self._has_stops = self._stops.has_stops
        # Set by the delta whose text completed a stop string (the request ends there; the caller aborts it).
        self.stopped_by_string = False
        self._min_tokens = sampling.min_tokens
        self.num_prompt_tokens = len(prompt_ids)
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.finish_reason = ""

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)

    def process(self, delta: scheduler_pb2.RequestDelta) -> generate_pb2.GenerateResponse | None:
        """The public delta for one scheduler message; None when there is nothing to send yet.

        Runs once per delta of every request: the common case (no stop strings, no logprobs, not the last delta)
        takes no detour."""
        if self.finish_reason:
            return None
        token_ids = delta.token_ids[:]  # a list (cheaper than list() of the repeated field)
        if delta.num_cached_tokens > self.num_cached_tokens:
            self.num_cached_tokens = delta.num_cached_tokens
        if self._has_stops:
            text, num_kept = self._push_stopped(token_ids)
        else:
            self.num_output_tokens += len(token_ids)
            text, num_kept = self._detokenizer.push(token_ids), len(token_ids)
        logprobs = delta.logprobs
        if num_kept < len(token_ids):
            # Tokens after the one that completed a stop string are not part of the output (text, ids, usage).
            del token_ids[num_kept:]
            logprobs = logprobs[:num_kept]
        finish = FINISH_REASONS.get(delta.finish_reason, "")
        if finish and not self._stops.stopped:
            text += self._stops.push(self._detokenizer.flush(), self._may_stop())
            text += self._stops.flush()
        if self._stops.stopped:
            self.stopped_by_string = True
            finish = "stop"
        self.finish_reason = finish
        if not (token_ids or text or finish):
            return None
        out = generate_pb2.GenerateResponse(text=text, token_ids=token_ids, request_id=self.request_id)
        if logprobs:
            out.logprobs.extend(self._named_logprob(logprob) for logprob in logprobs)
        if delta.prompt_logprobs:
            out.prompt_logprobs.extend(self._named_logprob(logprob) for logprob in delta.prompt_logprobs)
        if finish:
            out.finish_reason = finish
            out.usage.CopyFrom(self.usage())
        return out

    def _may_stop(self) -> bool:
        # Like EOS, a stop string cannot end the request before min_tokens tokens.
        return self.num_output_tokens > self._min_tokens

    def _push_stopped(self, token_ids: list[int]) -> tuple[str, int]:
        """With stop strings: the text safe to emit for ``token_ids`` and how many of them to keep, all of them or
        those up to and including the one that completed a stop string (a delta may carry several tokens)."""
        text = ""
        for i, token_id in enumerate(token_ids):
            self.num_output_tokens += 1
            text += self._stops.push(self._detokenizer.push([token_id]), self._may_stop())
            if self._stops.stopped:
                return text, i + 1
        return text, len(token_ids)

    def usage(self) -> common_pb2.Usage:
        return common_pb2.Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_output_tokens,
            cached_prompt_tokens=self.num_cached_tokens,
        )

    def _named_logprob(self, logprob: _Logprob) -> _Logprob:
        out = type(logprob)()
        out.CopyFrom(logprob)
        out.token = self._tokenizer.token_text(logprob.token_id)
        for top in out.top:
            top.token = self._tokenizer.token_text(top.token_id)
        return out


def merge(responses: list[generate_pb2.GenerateResponse | None]) -> generate_pb2.GenerateResponse | None:
    """One response carrying the text, ids and logprobs of ``responses`` in order; the last one's end fields."""
    present = [r for r in responses if r is not None]
    if len(present) <= 1:
        return present[0] if present else None
    out, rest = present[0], present[1:]
    # Each field written once: a whole request's deltas (a completion that is not streamed) are many.
    out.text = "".join([out.text, *(more.text for more in rest)])
    out.token_ids.extend([token for more in rest for token in more.token_ids])
    for more in rest:
        if more.logprobs:
            out.logprobs.extend(more.logprobs)
        if more.prompt_logprobs:
            out.prompt_logprobs.extend(more.prompt_logprobs)
    ended = [more for more in rest if more.finish_reason]
    if ended:
        out.finish_reason = ended[-1].finish_reason
        out.usage.CopyFrom(ended[-1].usage)
    return out
