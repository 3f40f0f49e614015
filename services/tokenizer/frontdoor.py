"""The one way in: every entry point turns a request into an ``EngineRequest`` here.

The gRPC servicer (Generate, Chat, Tokenize), the OpenAI routes, the offline ``LLM`` and
``kvgrid run-batch`` all call ``FrontDoor.prepare``: check the request id and the sampling
fields, apply the chat template, tokenize, check the prompt against the model's limits, and
fix what the scheduler gets. A rule added here holds for every API at once, with the same
message; a failure raises ``InvalidArgument`` naming the field (``sampling.<name>`` for
sampling fields, which each API may rename for its clients).

What a request may cost is checked before the cost is paid: a prompt's length in characters before
it is tokenized, and a structured-output spec's build against llguidance's fuel (``grammar_check``),
off the event loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from dataclasses import field as _field

from kvgrid.v1 import common_pb2, generate_pb2, worker_pb2
from services.common import pooling
from services.common.errors import InvalidArgument
from services.tokenizer import validation as v
from services.tokenizer.chat_template import RESERVED
from services.tokenizer.multimodal.images import ImageInputs, ImageSource, split_images, template_takes_parts, text_of
from services.tokenizer.multimodal.images import for_template as images_for_template
from services.tokenizer.multimodal.media import MediaPolicy
from services.tokenizer.openai.tools.parser import ToolParser
from services.tokenizer.openai.tools.support import ToolSupport, check_tool_values, check_tools, needs_tool_template
from services.tokenizer.openai.tools.types import ToolRequest
from services.tokenizer.text_tokenizer import TextTokenizer

# Inputs at least this long are tokenized in a thread, so that one big prompt does not stall every other stream.
LONG_INPUT_CHARS = 8192
# The prompt-length cap of a caller that knows no model limits (``tokenize`` without ``max_chars``): what a
# model of 8192 tokens allows (see ``validation.MAX_CHARS_PER_TOKEN``).
DEFAULT_MAX_PROMPT_CHARS = v.MAX_CHARS_PER_TOKEN * 8192
# A request's own chat template (--trust-request-chat-template): as long as a model's own ever is.
MAX_REQUEST_TEMPLATE_CHARS = 65536
# Inputs of one embeddings request (OpenAI's limit).
MAX_POOLING_INPUTS = 2048


@dataclass(slots=True)
class TextPrompt:
    text: str
    field: str = "prompt"
    add_special_tokens: bool = True
    images: list = _field(default_factory=list)  # each a URL, encoded bytes or a PIL image, for its image token


@dataclass(slots=True)
class TokensPrompt:
    token_ids: list[int]
    field: str = "prompt_token_ids"


@dataclass(slots=True)
class ChatPrompt:
    """``messages`` as ``{"role", "content"}`` dicts (an assistant's may carry ``tool_calls``, a tool's its
    ``tool_call_id``), rendered with the model's chat template; ``tools``: what the model may call."""

    messages: list[dict]
    field: str = "messages"
    tools: ToolRequest | None = None
    chat_template: str | None = None  # the request's own template (vLLM's field), in place of the model's
    chat_template_kwargs: dict | None = None  # more variables for the template (e.g. enable_thinking)


Prompt = TextPrompt | TokensPrompt | ChatPrompt


@dataclass(slots=True)
class EngineRequest:
    """A checked, tokenized request: what the engine runs and what the output path needs to turn it into text."""

    request_id: str
    prompt_ids: list[int]
    sampling: common_pb2.SamplingParams  # as the client asked (stop strings kept: the output path applies them)
    max_tokens: int  # max_tokens resolved and capped so that prompt + output fits the model
    prompt_text: str | None = None  # the prompt as text, when it was given as text
    pooling: common_pb2.PoolingParams | None = None  # a pooling request's params, resolved (no sampling then)
    tool_parser: ToolParser | None = None  # set when the output is to be read for tool calls
    mm_inputs: list = field(default_factory=list)  # the prompt's images (common_pb2.MultiModalInput), in order
    lora: common_pb2.LoraRequest | None = None  # the LoRA adapter to run with (see lora_registry); None: the base

    def scheduler_sampling(self) -> common_pb2.SamplingParams:
        """The sampling params the scheduler gets: max_tokens explicit, stop strings left to the frontend."""
        out = common_pb2.SamplingParams()
        out.CopyFrom(self.sampling)
        out.ClearField("stop")
        out.max_tokens = self.max_tokens
        out.min_tokens = min(self.sampling.min_tokens, self.max_tokens)
        return out

    def with_sampling(self, request_id: str, sampling: common_pb2.SamplingParams) -> EngineRequest:
        """The same prompt as another choice (its own id and, for a seeded request, its own seed)."""
        return EngineRequest(
            request_id,
            self.prompt_ids,
            sampling,
            self.max_tokens,
            self.prompt_text,
            self.pooling,
            self.tool_parser,
            self.mm_inputs,
            self.lora,
        )


@dataclass(slots=True)
class FrontDoor:
    """Checks and tokenizes requests for one tokenizer and the served model's limits."""

    tokenizer: TextTokenizer
    limits: v.ModelLimits
    pooler: worker_pb2.PoolerConfig | None = None  # a pooling server's defaults (--runner pooling); None: generate
    tools: ToolSupport = field(default_factory=ToolSupport.named)
    images: ImageInputs | None = None  # the served model's image processing; None: text only
    # --trust-request-chat-template: a chat may bring its own template (rendered in the same sandbox, but a
    # template can loop for as long as it likes, so only trusted clients should be let to send one).
    trust_request_chat_template: bool = False

    def prepare(self, prompt: Prompt, sampling: common_pb2.SamplingParams, request_id: str) -> EngineRequest:
        """Raises ``InvalidArgument`` naming the first bad field: request id, tools, sampling, prompt, length.
        A chat's ``tool_choice`` becomes the grammar in the sampling params the engine gets."""
        pooling.check_runner("model", False, self.pooler is not None)
        v.check_request_id(request_id)
        check_prompt_size(prompt, self.limits.max_prompt_chars)
        if isinstance(prompt, ChatPrompt):
            check_template_fields(prompt, self.trust_request_chat_template)
        parser = None
        tool_grammar = False
        if isinstance(prompt, ChatPrompt) and prompt.tools is not None:
            check_tools(prompt.tools)
            constrained = self.tools.sampling(prompt.tools, sampling)
            tool_grammar, sampling = constrained is not sampling, constrained
            parser = self.tools.parser if prompt.tools.active else None
        try:
            v.check_sampling(sampling, self.limits)
        except InvalidArgument as exc:
            if not (tool_grammar and exc.field == "sampling.grammar"):
                raise
            # The grammar is the tools': a schema llguidance cannot compile, or too costly to build.
            raise InvalidArgument("tools", str(exc).removeprefix(f"{exc.field}: ")) from None
        if tool_grammar:
            check_tool_values(prompt.tools, self.limits.grammars)
        if isinstance(prompt, TextPrompt) and prompt.text == "":
            raise InvalidArgument(prompt.field, "empty: give text or token ids")
        prompt, sources = self._take_images(prompt)
        images = self.images or ImageInputs(None, MediaPolicy())
        processed = images.process(sources)
        ids = _tokenize(self.tokenizer, prompt, self.tools)
        mm_inputs: list = []
        if processed:
            encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
            ids, mm_inputs = images.expand(ids, processed, prompt.field, encode)
        if isinstance(prompt, TokensPrompt):
            v.check_token_ids(prompt.field, ids, self.limits.vocab_size)
        v.check_prompt_length(prompt.field, len(ids), self.limits)
        room = self.limits.max_model_len - len(ids)
        max_tokens = min(sampling.max_tokens or v.DEFAULT_MAX_TOKENS, room)
        text = prompt.text if isinstance(prompt, TextPrompt) else None
        return EngineRequest(request_id, ids, sampling, max_tokens, text, tool_parser=parser, mm_inputs=mm_inputs)

    def _take_images(self, prompt: Prompt) -> tuple[Prompt, list[ImageSource]]:
        """The prompt as the tokenizer reads it (chat: image parts as the template takes them) and its images."""
        if isinstance(prompt, TextPrompt) and prompt.images:
            return prompt, [ImageSource(f"multi_modal_data.image[{i}]", x) for i, x in enumerate(prompt.images)]
        if not isinstance(prompt, ChatPrompt) or not _has_images(prompt):
            return prompt, []
        messages, sources = split_images(prompt.messages, prompt.field)
        template = self.tokenizer.chat_template
        spec = self.images.spec if self.images is not None else None
        if spec is not None or not sources:
            token = spec.image_token if spec is not None else ""
            messages = images_for_template(
                messages, token, template is not None and template_takes_parts(template.source)
            )
        return ChatPrompt(messages, prompt.field, prompt.tools), sources

    def prepare_pooling(
        self, prompts: list[Prompt], params: common_pb2.PoolingParams, request_id: str
    ) -> list[EngineRequest]:
        """Pooling requests (embeddings) for ``prompts``, one each, with ids ``<request_id>-<i>`` and the params
        resolved with the server's defaults. Raises ``InvalidArgument`` naming the first bad field."""
        pooling.check_runner("model", True, self.pooler is not None)
        v.check_request_id(request_id)
        if not prompts or len(prompts) > MAX_POOLING_INPUTS:
            raise InvalidArgument("input", f"give 1 to {MAX_POOLING_INPUTS} inputs, got {len(prompts)}")
        resolved = pooling.resolve(params, self.pooler)
        requests = []
        for i, prompt in enumerate(prompts):
            check_prompt_size(prompt, self.limits.max_prompt_chars)
            if isinstance(prompt, TextPrompt) and prompt.text == "":
                raise InvalidArgument(prompt.field, "empty: give text or token ids")
            ids = _tokenize(self.tokenizer, prompt)
            if isinstance(prompt, TokensPrompt):
                v.check_token_ids(prompt.field, ids, self.limits.vocab_size)
            v.check_prompt_length(prompt.field, len(ids), self.limits)
            text = prompt.text if isinstance(prompt, TextPrompt) else None
            sampling = common_pb2.SamplingParams()
            requests.append(EngineRequest(f"{request_id}-{i}", ids, sampling, 0, text, resolved))
        return requests

    async def prepare_pooling_async(
        self, prompts: list[Prompt], params: common_pb2.PoolingParams, request_id: str
    ) -> list[EngineRequest]:
        """``prepare_pooling``, with many or long inputs tokenized off the event loop."""
        if sum(num_chars(prompt) for prompt in prompts) < LONG_INPUT_CHARS:
            return self.prepare_pooling(prompts, params, request_id)
        return await asyncio.to_thread(self.prepare_pooling, prompts, params, request_id)

    async def prepare_async(
        self, prompt: Prompt, sampling: common_pb2.SamplingParams, request_id: str
    ) -> EngineRequest:
        """``prepare``, with long inputs tokenized and structured-output specs checked off the event loop (a spec's
        check builds it against the vocabulary: milliseconds, up to the fuel budget, once per distinct spec)."""
        check_prompt_size(prompt, self.limits.max_prompt_chars)  # refused here: no thread for a prompt never read
        constrained = sampling.WhichOneof("structured_output") is not None or _tool_constrained(prompt)
        if num_chars(prompt) < LONG_INPUT_CHARS and not constrained and not _has_images(prompt):
            return self.prepare(prompt, sampling, request_id)
        return await asyncio.to_thread(self.prepare, prompt, sampling, request_id)  # images are decoded there too


def tokenize(tokenizer: TextTokenizer, prompt: Prompt, max_chars: int | None = None) -> list[int]:
    """The prompt's token ids (chat: the template with the assistant's turn opened). Before tokenizing, a prompt
    of more than ``max_chars`` characters (default ``DEFAULT_MAX_PROMPT_CHARS``; the model's limit is
    ``ModelLimits.max_prompt_chars``) and text that is not valid Unicode are INVALID_ARGUMENT; the length in
    tokens is the caller's check."""
    check_prompt_size(prompt, DEFAULT_MAX_PROMPT_CHARS if max_chars is None else max_chars)
    return _tokenize(tokenizer, prompt)


async def tokenize_async(tokenizer: TextTokenizer, prompt: Prompt, max_chars: int | None = None) -> list[int]:
    """``tokenize``, with long inputs off the event loop."""
    check_prompt_size(prompt, DEFAULT_MAX_PROMPT_CHARS if max_chars is None else max_chars)
    if num_chars(prompt) < LONG_INPUT_CHARS:
        return _tokenize(tokenizer, prompt)
    return await asyncio.to_thread(_tokenize, tokenizer, prompt)


def _has_images(prompt: Prompt) -> bool:
    if isinstance(prompt, TextPrompt):
        return bool(prompt.images)
    return isinstance(prompt, ChatPrompt) and any(isinstance(m.get("content"), list) for m in prompt.messages)


def _tool_constrained(prompt: Prompt) -> bool:
    return isinstance(prompt, ChatPrompt) and prompt.tools is not None and prompt.tools.active


def _tokenize(tokenizer: TextTokenizer, prompt: Prompt, tools: ToolSupport | None = None) -> list[int]:
    """``tokenize`` for a prompt that passed ``check_prompt_size``."""
    if isinstance(prompt, TokensPrompt):
        ids = list(prompt.token_ids)
        for i, token_id in enumerate(ids):
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise InvalidArgument(f"{prompt.field}[{i}]", f"token ids are integers >= 0, got {token_id!r}")
        return ids
    if isinstance(prompt, ChatPrompt):
        for i, m in enumerate(prompt.messages):
            v.check_text(f"{prompt.field}[{i}].content", text_of(m.get("content")))
        if tokenizer.chat_template is None:
            raise InvalidArgument(prompt.field, "the model's tokenizer has no chat template; send a plain prompt")
        offered = prompt.tools.tools if prompt.tools is not None else []  # with tool_choice none too, as OpenAI
        tool_dicts = [tool.as_template_tool() for tool in offered]
        template = None
        if prompt.chat_template is not None:
            try:
                template = tokenizer.request_template(prompt.chat_template)
            except ValueError as exc:
                raise InvalidArgument("chat_template", str(exc)) from None
        elif needs_tool_template(prompt.messages, tool_dicts) and not tokenizer.chat_template.uses_tools:
            template = tokenizer.template_for((tools or ToolSupport.named()).template_source)
        try:
            return tokenizer.encode_chat(prompt.messages, tool_dicts, template, prompt.chat_template_kwargs)
        except InvalidArgument as exc:
            if prompt.chat_template is None:
                raise
            raise InvalidArgument("chat_template", str(exc).removeprefix(f"{exc.field}: ")) from None
    v.check_text(prompt.field, prompt.text)
    return tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens)


def check_template_fields(prompt: ChatPrompt, trusted: bool) -> None:
    """A request's own chat template: allowed by the server, and of a bounded size; its kwargs: a mapping of
    names that are not the conversation's own variables."""
    if prompt.chat_template is not None:
        if not trusted:
            raise InvalidArgument(
                "chat_template",
                "a chat template per request is refused by this server (start it with --trust-request-chat-template"
                " to accept one)",
            )
        if len(prompt.chat_template) > MAX_REQUEST_TEMPLATE_CHARS:
            raise InvalidArgument(
                "chat_template", f"at most {MAX_REQUEST_TEMPLATE_CHARS} characters, got {len(prompt.chat_template)}"
            )
    kwargs = prompt.chat_template_kwargs
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise InvalidArgument("chat_template_kwargs", "must be an object of template variables")
    for name in kwargs:
        if name in RESERVED:
            raise InvalidArgument(f"chat_template_kwargs.{name}", "set by kvgrid from the request itself")


def check_prompt_size(prompt: Prompt, max_chars: int) -> None:
    """The prompt's shape (text, or chat messages of known roles) and its length in characters: checks that cost
    nothing next to tokenizing it, made before anything reads the text. (A prompt of token ids has its length
    checked in tokens.)"""
    if isinstance(prompt, TokensPrompt):
        return
    if isinstance(prompt, ChatPrompt):
        check_messages(prompt.field, prompt.messages)
    elif not isinstance(prompt.text, str):
        raise InvalidArgument(prompt.field, f"must be text, got {type(prompt.text).__name__}")
    v.check_prompt_chars(prompt.field, num_chars(prompt), max_chars)


def check_messages(field: str, messages: list[dict]) -> None:
    """Chat messages as dicts: each a ``{"role": ..., "content": "..."}`` with a known role."""
    roles = []
    for i, m in enumerate(messages):
        content = m.get("content", "") if isinstance(m, dict) else None
        if not isinstance(content, str | list) or not isinstance(m.get("role"), str):
            raise InvalidArgument(f"{field}[{i}]", 'each message is {"role": "...", "content": "..."}')
        v.check_text(f"{field}[{i}].role", m["role"])
        roles.append(generate_pb2.ChatMessage(role=m["role"]))  # the content is checked (and copied) by no one here
    v.check_messages(field, roles)


def num_chars(prompt: Prompt) -> int:
    """Characters of text (chat: of the messages' contents), for a prompt whose shape was checked."""
    if isinstance(prompt, TextPrompt):
        return len(prompt.text) if isinstance(prompt.text, str) else 0
    if isinstance(prompt, ChatPrompt):
        return sum(len(text_of(m.get("content"))) for m in prompt.messages if isinstance(m, dict))
    return 0
