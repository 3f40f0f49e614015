"""An OpenAI request body through the front door: its fields as SamplingParams, each prompt prepared,
its n choices planned, and the renderer that will answer it.

The HTTP routes and ``kvgrid run-batch`` both call ``prepare_completion`` / ``prepare_chat``, so the
same body gets the same answer or the same error from either. A failure raises ``KvgridError``;
an ``InvalidArgument`` carries ``public_field``, the request's own name of the bad field.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from kvgrid.v1 import common_pb2
from services.common.errors import InvalidArgument
from services.tokenizer.frontdoor import ChatPrompt, EngineRequest, FrontDoor, TextPrompt, TokensPrompt
from services.tokenizer.openai import params as p
from services.tokenizer.openai.errors import ModelNotFound
from services.tokenizer.openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from services.tokenizer.openai.render import Renderer
from services.tokenizer.openai.tools.support import template_tool_calls
from services.tokenizer.openai.tools.types import FunctionTool, ToolChoice, ToolRequest

ROLES = {"developer": "system"}  # OpenAI's newer name for the system role
T = TypeVar("T")
_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class Choice:
    index: int
    prompt_index: int
    request: EngineRequest
    leader: bool  # the first choice of its prompt: its siblings wait for its prompt to be cached


@dataclass(slots=True)
class PreparedOpenAI:
    """Everything needed to run and answer one OpenAI request."""

    choices: list[Choice]
    renderer: Renderer
    stream: bool
    include_usage: bool


def check_model(asked: str | None, served: str) -> str:
    if asked and asked != served:
        raise ModelNotFound(asked, served)
    return served


async def prepare_completion(req: CompletionRequest, door: FrontDoor, served: str) -> PreparedOpenAI:
    model = check_model(req.model, served)
    fields = _named(lambda: p.completion_sampling(req), None)
    request_id = _request_id(req.request_id)
    prompt = req.prompt
    batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
    items = prompt if batch else [prompt]
    prepared: list[EngineRequest] = []
    echo: dict[int, str] = {}
    echo_tokens: dict[int, str] = {}  # the first token of each echoed prompt, when its tokens lead the logprobs
    for i, item in enumerate(items):
        field = f"prompt[{i}]" if batch else "prompt"
        given = TextPrompt(item, field) if isinstance(item, str) else TokensPrompt(list(item), field)
        prepared.append(await _named_async(lambda g=given: door.prepare_async(g, fields.params, request_id), fields))
        if req.echo:
            ids = prepared[-1].prompt_ids
            echo[i] = item if isinstance(item, str) else door.tokenizer.decode(ids, skip_special_tokens=False)
            if req.logprobs is not None:
                echo_tokens[i] = door.tokenizer.token_text(ids[0])
    num_top = p.num_top_logprobs(req)
    renderer = Renderer(False, request_id, model, req.n, num_top, echo, echo_tokens, req.prompt_logprobs)
    return PreparedOpenAI(plan_choices(request_id, prepared, req.n), renderer, req.stream, req.include_usage)


async def prepare_chat(req: ChatCompletionRequest, door: FrontDoor, served: str) -> PreparedOpenAI:
    model = check_model(req.model, served)
    fields = _named(lambda: p.chat_sampling(req, door.limits), None)
    request_id = _request_id(req.request_id)
    tools = tool_request(req)
    if tools is not None and tools.active:
        fields.names["grammar"] = "tools"  # the grammar is the tools' (a schema that does not compile)
    prompt = ChatPrompt(
        chat_messages(req.messages),
        tools=tools,
        chat_template=req.chat_template,
        chat_template_kwargs=req.chat_template_kwargs,
    )
    prepared = await _named_async(lambda: door.prepare_async(prompt, fields.params, request_id), fields)
    renderer = Renderer(
        True, request_id, model, req.n, p.num_top_logprobs(req), {}, None, req.prompt_logprobs, prepared.tool_parser
    )
    return PreparedOpenAI(plan_choices(request_id, [prepared], req.n), renderer, req.stream, req.include_usage)


def plan_choices(request_id: str, prompts: list[EngineRequest], n: int) -> list[Choice]:
    """Choice ``i * n + j`` is sample j of prompt i. A seed gives sample j the seed + j, so the n samples
    differ and each is reproducible."""
    choices = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            index = i * n + j
            params = common_pb2.SamplingParams()
            params.CopyFrom(prompt.sampling)
            if params.HasField("seed"):
                params.seed = (params.seed + j) & _MASK64
            rid = request_id if len(prompts) * n == 1 else f"{request_id}-{index}"
            choices.append(Choice(index, i, prompt.with_sampling(rid, params), leader=j == 0))
    return choices


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI's messages as ``{"role", "content"}`` dicts for the front door; text parts are joined; an
    assistant's ``tool_calls`` and a tool message's ``tool_call_id`` and ``name`` are kept."""
    out = []
    for m in messages:
        parts = m.parts()
        message: dict = {"role": ROLES.get(m.role, m.role), "content": m.text() if parts is None else parts}
        if m.tool_calls:
            calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls]
            message["tool_calls"] = template_tool_calls(calls)
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


def tool_request(req: ChatCompletionRequest) -> ToolRequest | None:
    """The request's tools and tool_choice (OpenAI's default: ``auto`` with tools, ``none`` without)."""
    if req.tools is None and req.tool_choice is None:
        return None
    tools = [
        FunctionTool(t.function.name, t.function.description or "", t.function.parameters or {})
        for t in req.tools or []
    ]
    given = req.tool_choice
    if given is None:
        choice = ToolChoice("auto" if tools else "none")
    elif isinstance(given, str):
        choice = ToolChoice(given)
    else:
        choice = ToolChoice("function", given.function.name)
    return ToolRequest(tools, choice, req.parallel_tool_calls)


def _request_id(given: str | None) -> str:
    return uuid.uuid4().hex if given is None else given


def _named(check: Callable[[], T], fields: p.SamplingFields | None) -> T:
    """Run ``check``; an InvalidArgument leaves with the client's name of its field in ``public_field``."""
    try:
        return check()
    except InvalidArgument as exc:
        exc.public_field = fields.public_field(exc.field) if fields is not None else exc.field
        raise


async def _named_async(work: Callable[[], Awaitable[T]], fields: p.SamplingFields) -> T:
    try:
        return await work()
    except InvalidArgument as exc:
        exc.public_field = fields.public_field(exc.field)
        raise
