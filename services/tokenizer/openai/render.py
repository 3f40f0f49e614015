"""Pipeline deltas (GenerateResponse) to OpenAI bodies: whole responses, and stream chunks as they come.

One ``Renderer`` per request accumulates what each choice produced; the completions and chat flavours
differ only in how one choice's text and logprobs are written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvgrid.v1 import generate_pb2
from services.tokenizer.openai import responses as r
from services.tokenizer.openai.prompt_logprobs import echo_entries, vllm_prompt_logprobs
from services.tokenizer.openai.tools.parser import ToolParser
from services.tokenizer.openai.tools.streaming import ToolCallStream
from services.tokenizer.openai.tools.types import new_call_id


@dataclass(slots=True)
class ChoiceState:
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # CompletionLogprobs entries or chat TokenLogprob
    text_offset: int = 0  # characters of this choice's text so far (completions' text_offset)
    started: bool = False  # a chunk of this choice was sent (the chat role goes in the first)
    unsent_prefix: str = ""  # the echoed prompt, until the first chunk carries it
    finish_reason: str | None = None
    usage: generate_pb2.GenerateResponse | None = None
    prompt_logprobs: list | None = None  # vLLM's shape, when prompt_logprobs was asked for
    tool_stream: ToolCallStream | None = None  # a streamed chat choice read for tool calls


class Renderer:
    """``echo`` (completions): prompt index -> text to put before each choice of that prompt. ``echo_tokens``: prompt
    index -> the text of its first token, when the echoed prompt's tokens lead the logprobs (echo with logprobs).
    ``num_prompt_logprobs``: vLLM's ``prompt_logprobs`` field, when set. ``tool_parser`` (chat): reads each choice's
    text for tool calls."""

    def __init__(
        self,
        chat: bool,
        request_id: str,
        model: str,
        n: int,
        num_top: int | None,
        echo: dict[int, str],
        echo_tokens: dict[int, str] | None = None,
        num_prompt_logprobs: int | None = None,
        tool_parser: ToolParser | None = None,
    ):
        self.chat = chat
        self.request_id = request_id
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())
        self.n = n
        self.num_top = num_top  # None: no logprobs asked for
        self.echo = echo
        self.echo_tokens = echo_tokens or {}
        self.num_prompt_logprobs = num_prompt_logprobs
        self.tool_parser = tool_parser
        self.choices: dict[int, ChoiceState] = {}

    def add(self, index: int, delta: generate_pb2.GenerateResponse) -> ChoiceState:
        state = self.choices.get(index)
        if state is None:
            state = self.choices[index] = ChoiceState()
            prefix = self.echo.get(index // self.n, "")
            state.text.append(prefix)
            state.text_offset = len(prefix)
            state.unsent_prefix = prefix
            self._add_prompt_logprobs(index, state, delta)
        state.text.append(delta.text)
        self._add_logprobs(state, delta)
        if delta.finish_reason:
            state.finish_reason, state.usage = delta.finish_reason, delta
        return state

    # --- whole responses ---

    def response(self) -> r.CompletionResponse | r.ChatCompletionResponse:
        indexes = sorted(self.choices)
        if self.chat:
            prompt_logprobs = next((c.prompt_logprobs for c in self.choices.values() if c.prompt_logprobs), None)
            choices = [
                r.ChatChoice(
                    index=i,
                    message=self._message("".join(self.choices[i].text)),
                    logprobs=None if self.num_top is None else r.ChatLogprobs(content=self.choices[i].logprobs),
                    finish_reason=self._finish_reason(self.choices[i].finish_reason, self._has_calls(i)),
                )
                for i in indexes
            ]
            return r.ChatCompletionResponse(
                id=self.id,
                created=self.created,
                model=self.model,
                choices=choices,
                usage=self.usage(),
                prompt_logprobs=prompt_logprobs,
            )
        choices = [
            r.CompletionChoice(
                index=i,
                text="".join(self.choices[i].text),
                logprobs=self._completion_logprobs(self.choices[i].logprobs),
                finish_reason=self.choices[i].finish_reason,
                prompt_logprobs=self.choices[i].prompt_logprobs,
            )
            for i in indexes
        ]
        return r.CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=self.usage()
        )

    def _message(self, text: str) -> r.AssistantMessage:
        if self.tool_parser is None:
            return r.AssistantMessage(content=text)
        parsed = self.tool_parser.parse(text, final=True)
        calls = [
            r.ToolCallOut(id=new_call_id(), function=r.FunctionCall(name=c.name, arguments=c.arguments))
            for c in parsed.calls
        ]
        return r.AssistantMessage(content=parsed.content or (None if calls else ""), tool_calls=calls or None)

    def _has_calls(self, index: int) -> bool:
        if self.tool_parser is None:
            return False
        state = self.choices[index]
        if state.tool_stream is not None:
            return bool(state.tool_stream.call_ids)
        return bool(self.tool_parser.parse("".join(state.text), final=True).calls)

    @staticmethod
    def _finish_reason(finish: str | None, has_calls: bool) -> str | None:
        """OpenAI's ``tool_calls`` for an answer that ended in calls of its own accord."""
        return "tool_calls" if finish == "stop" and has_calls else finish

    def usage(self) -> r.Usage:
        """Prompt tokens count once per prompt, whatever n is; completion tokens add up over choices."""
        prompt: dict[int, int] = {}
        cached: dict[int, int] = {}
        completion = 0
        for index, state in self.choices.items():
            if state.usage is None:
                continue
            u = state.usage.usage
            prompt[index // self.n] = u.prompt_tokens
            cached[index // self.n] = max(cached.get(index // self.n, 0), u.cached_prompt_tokens)
            completion += u.completion_tokens
        num_prompt = sum(prompt.values())
        return r.Usage(
            prompt_tokens=num_prompt,
            completion_tokens=completion,
            total_tokens=num_prompt + completion,
            prompt_tokens_details=r.PromptTokensDetails(cached_tokens=sum(cached.values())),
        )

    # --- stream chunks ---

    def chunk(self, index: int, delta: generate_pb2.GenerateResponse) -> str | None:
        """The chunk for one delta (JSON), or None when it carries nothing a client would see."""
        state = self.choices.get(index)
        num_logprobs_before = 0 if state is None else len(state.logprobs)
        state = self.add(index, delta)
        first = not state.started
        text = state.unsent_prefix + delta.text
        new_logprobs = state.logprobs[num_logprobs_before:]
        if not (text or delta.finish_reason or new_logprobs or (first and self.chat)):
            return None
        state.started, state.unsent_prefix = True, ""
        finish = delta.finish_reason or None
        if self.chat and self.tool_parser is not None:
            return self._tool_chunk(index, state, delta, first, new_logprobs)
        if self.chat:
            choice = r.ChatChunkChoice(
                index=index,
                delta=r.DeltaMessage(role="assistant" if first else None, content=text),
                logprobs=None if self.num_top is None else r.ChatLogprobs(content=new_logprobs),
                finish_reason=finish,
            )
            body = r.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])
        else:
            choice = r.CompletionChoice(
                index=index, text=text, logprobs=self._completion_logprobs(new_logprobs), finish_reason=finish
            )
            body = r.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice])
        return body.model_dump_json()

    def _tool_chunk(self, index: int, state: ChoiceState, delta, first: bool, new_logprobs: list) -> str | None:
        """A chat chunk whose text went through the tool-call stream: content and call deltas."""
        if state.tool_stream is None:
            state.tool_stream = ToolCallStream(self.tool_parser)
        pushed = state.tool_stream.push(delta.text, final=bool(delta.finish_reason))
        calls = [c.as_openai() for c in pushed.calls] or None
        if not (pushed.content or calls or delta.finish_reason or new_logprobs or first):
            return None
        finish = self._finish_reason(delta.finish_reason or None, bool(state.tool_stream.call_ids))
        choice = r.ChatChunkChoice(
            index=index,
            delta=r.DeltaMessage(
                role="assistant" if first else None,
                content=pushed.content or None if calls else pushed.content,
                tool_calls=calls,
            ),
            logprobs=None if self.num_top is None else r.ChatLogprobs(content=new_logprobs),
            finish_reason=finish,
        )
        body = r.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])
        return body.model_dump_json()

    def usage_chunk(self) -> str:
        cls = r.ChatCompletionChunk if self.chat else r.CompletionResponse
        return cls(id=self.id, created=self.created, model=self.model, choices=[], usage=self.usage()).model_dump_json()

    # --- logprobs ---

    def _add_prompt_logprobs(self, index: int, state: ChoiceState, delta: generate_pb2.GenerateResponse) -> None:
        """On the choice's first delta, which carries the prompt's logprobs (none for a one-token prompt)."""
        first_token = self.echo_tokens.get(index // self.n)
        if first_token is not None and self.num_top is not None:
            state.logprobs += echo_entries(first_token, delta.prompt_logprobs, self.num_top)
        if self.num_prompt_logprobs is not None:
            state.prompt_logprobs = vllm_prompt_logprobs(delta.prompt_logprobs, self.num_prompt_logprobs)

    def _add_logprobs(self, state: ChoiceState, delta: generate_pb2.GenerateResponse) -> None:
        if self.num_top is None:
            return
        for lp in delta.logprobs:
            top = list(lp.top)[: self.num_top]
            if self.chat:
                alternatives = [r.TopLogprob(token=t.token, logprob=t.logprob, bytes=_bytes(t.token)) for t in top]
                state.logprobs.append(
                    r.TokenLogprob(
                        token=lp.token, logprob=lp.logprob, bytes=_bytes(lp.token), top_logprobs=alternatives
                    )
                )
            else:
                state.logprobs.append((lp.token, lp.logprob, {t.token: t.logprob for t in top}, state.text_offset))
                state.text_offset += len(lp.token)

    def _completion_logprobs(self, entries: list) -> r.CompletionLogprobs | None:
        if self.num_top is None:
            return None
        return r.CompletionLogprobs(
            tokens=[e[0] for e in entries],
            token_logprobs=[e[1] for e in entries],
            top_logprobs=[e[2] for e in entries],
            text_offset=[e[3] for e in entries],
        )


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))
