"""One request's output: the scheduler's token deltas in, public GenerateResponse deltas out.

Text goes through the incremental detokenizer, then the stop-string matcher; the
token ids and logprobs pass through as they arrive. The response that ends the
request (the scheduler's finish, or a stop string found here) carries
finish_reason and usage.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgrid.v1 import common_pb2, generate_pb2, scheduler_pb2
from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.stop_strings import StopStringMatcher
from services.tokenizer.text_tokenizer import TextTokenizer

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
        self._min_tokens = sampling.min_tokens
        self.num_prompt_tokens = len(prompt_ids)
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.finish_reason = ""

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)

    @property
    def stopped_by_string(self) -> bool:
        return self._stops.stopped

    def process(self, delta: scheduler_pb2.RequestDelta) -> generate_pb2.GenerateResponse | None:
        """The public delta for one scheduler message; None when there is nothing to send yet."""
        if self.finished:
            return None
        token_ids = list(delta.token_ids)
        logprobs = list(delta.logprobs)
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        text, num_kept = self._push_tokens(token_ids)
        # Tokens after the one that completed a stop string are not part of the output (text, ids, usage alike).
        del token_ids[num_kept:], logprobs[num_kept:]
        finish = FINISH_REASONS.get(delta.finish_reason, "")
        if finish and not self._stops.stopped:
            text += self._stops.push(self._detokenizer.flush(), self._may_stop())
            text += self._stops.flush()
        if self._stops.stopped:
            finish = "stop"
        self.finish_reason = finish
        if not (token_ids or text or finish):
            return None
        out = generate_pb2.GenerateResponse(text=text, token_ids=token_ids, request_id=self.request_id)
        for logprob in logprobs:
            out.logprobs.append(self._named_logprob(logprob))
        if finish:
            out.finish_reason = finish
            out.usage.CopyFrom(self.usage())
        return out

    def _may_stop(self) -> bool:
        # Like EOS, a stop string cannot end the request before min_tokens tokens.
        return self.num_output_tokens > self._min_tokens

    def _push_tokens(self, token_ids: list[int]) -> tuple[str, int]:
        """The text safe to emit for ``token_ids`` and how many of them to keep: all of them, or those up to and
        including the one that completed a stop string (a delta may carry several tokens)."""
        if not self._stops.has_stops:
            self.num_output_tokens += len(token_ids)
            return self._detokenizer.push(token_ids), len(token_ids)
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

    def _named_logprob(self, logprob: common_pb2.TokenLogprob) -> common_pb2.TokenLogprob:
        out = common_pb2.TokenLogprob()
        out.CopyFrom(logprob)
        out.token = self._tokenizer.token_text(logprob.token_id)
        for top in out.top:
            top.token = self._tokenizer.token_text(top.token_id)
        return out
