"""Request bodies of the OpenAI-compatible API (with vLLM's extra sampling fields), as pydantic models.

Only types are checked here; ranges and limits are the front door's checks, so every API rejects the
same values with the same messages. What the protobuf messages cannot hold is refused here too: an
integer past its proto field's range (uint32, int32, uint64), and text with a lone surrogate (JSON's
"\\ud800", which no UTF-8 string holds) outside the prompt, whose text the front door checks for every
API. Unknown fields are ignored, as OpenAI's server does; but a field kvgrid knows of and does not support
(``UNSUPPORTED``) is refused by name rather than silently dropped, unless it carries the value that means "off".
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from services.tokenizer.validation import lone_surrogate

UInt32 = Annotated[int, Field(ge=0, lt=2**32)]
Int32 = Annotated[int, Field(ge=-(2**31), lt=2**31)]
MAX_N = 128
UNSUPPORTED_TYPE = "unsupported_field"  # the error type validation_error_handler names the field from
# Prompt text (a prompt, a message's content and its parts) is the front door's to check, with its length.
_PROMPT_FIELDS = frozenset({"prompt", "content", "text"})

_STRUCTURED = "the guided_* fields; use structured_outputs (json, regex, choice, grammar) or response_format"
# field -> (values that mean "off" and are accepted, what to say when another value is sent)
_SHARED_UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "logit_bias": ((None, {}), "logit biases"),
    "best_of": ((None, 1), "best_of above 1; use n for several samples"),
    "truncate_prompt_tokens": ((None,), "prompt truncation"),
    "guided_json": ((None,), _STRUCTURED),
    "guided_regex": ((None,), _STRUCTURED),
    "guided_choice": ((None,), _STRUCTURED),
    "guided_grammar": ((None,), _STRUCTURED),
    "guided_json_object": ((None, False), _STRUCTURED),
}
COMPLETION_UNSUPPORTED = {**_SHARED_UNSUPPORTED, "suffix": ((None, ""), "insertion (suffix)")}
CHAT_UNSUPPORTED = {
    **_SHARED_UNSUPPORTED,
    "functions": ((None, []), "function calling"),
    "function_call": ((None, "none"), "function calling"),
    "audio": ((None,), "audio output"),
    "modalities": ((None, ["text"]), "output other than text"),
    "prediction": ((None,), "predicted outputs"),
    "web_search_options": ((None,), "web search"),
    "continue_final_message": ((None, False), "continuing the final message"),
    "add_generation_prompt": ((None, True), "a conversation without the assistant's turn opened"),
    "echo": ((None, False), "echo in chat; it is a /v1/completions field"),
}


def refuse_unsupported(body: Any, unsupported: dict[str, tuple[tuple, str]]) -> Any:
    """A body field kvgrid knows and does not support, set to anything but "off": a 400 naming it."""
    if isinstance(body, dict):
        for name, (off, why) in unsupported.items():
            if name in body and not any(body[name] == value and type(body[name]) is type(value) for value in off):
                raise PydanticCustomError(
                    UNSUPPORTED_TYPE, "{field}: not supported by kvgrid ({why})", {"field": name, "why": why}
                )
    return body


def _surrogate_at(value: Any, path: str = "") -> str | None:
    """Where in ``value`` (text, or lists and dicts of it, e.g. a JSON schema) a lone surrogate is, or None."""
    at = f"{path}, " if path else ""
    if isinstance(value, str):
        index = lone_surrogate(value)
        return None if index < 0 else f"{at}character {index}"
    if isinstance(value, list | tuple):
        items = enumerate(value)
    elif isinstance(value, dict):
        if any(isinstance(key, str) and lone_surrogate(key) >= 0 for key in value):
            return f"{at}a key"
        items = ((repr(key), item) for key, item in value.items())
    else:
        return None
    for index, item in items:
        found = _surrogate_at(item, f"{path}[{index}]")
        if found is not None:
            return found
    return None


class CheckedModel(BaseModel):
    """A request part whose text fields (but the prompt's) must be valid Unicode."""

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name not in _PROMPT_FIELDS and not isinstance(value, BaseModel):
            where = _surrogate_at(value)
            if where is not None:
                raise PydanticCustomError(
                    "invalid_unicode", "not valid Unicode: a lone surrogate at {where}", {"where": where}
                )
        return value


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaSpec(CheckedModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(CheckedModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputs(CheckedModel):
    """vLLM's ``structured_outputs``: set one of these."""

    model_config = ConfigDict(populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingRequest(CheckedModel):
    """Fields completions and chat share."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, lt=2**32)] | None = None
    temperature: float | None = None  # OpenAI's default is 1
    top_p: float | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extras
    top_k: Int32 | None = None
    min_p: float = 0.0
    repetition_penalty: float | None = None
    min_tokens: UInt32 = 0
    ignore_eos: bool = False
    stop_token_ids: list[UInt32] | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    request_id: str | None = None
    prompt_logprobs: UInt32 | None = None  # at most 20: the front door's check

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[UInt32] | list[list[UInt32]]
    logprobs: UInt32 | None = None  # at most 20: the front door's check, as on gRPC
    echo: bool = False

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, body: Any) -> Any:
        return refuse_unsupported(body, COMPLETION_UNSUPPORTED)


class TextPart(CheckedModel):
    type: Literal["text"]
    text: str


class ImageURL(CheckedModel):
    url: str  # a data: URL, a file under --allowed-local-media-path, or http(s) from --allowed-media-domains
    detail: str | None = None  # accepted and ignored: the model's processor decides the resolution


class ImageURLPart(CheckedModel):
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCallParam(CheckedModel):
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it


class ToolCallParam(CheckedModel):
    """A call in an assistant message of the history."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallParam


class FunctionDef(CheckedModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (an object)
    strict: bool | None = None  # kvgrid holds every call to its schema when tool_choice asks for calls


class ToolParam(CheckedModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(CheckedModel):
    name: str


class NamedToolChoice(CheckedModel):
    type: Literal["function"]
    function: FunctionName


class ChatMessage(CheckedModel):
    role: str
    content: str | list[TextPart | ImageURLPart] | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""

    def parts(self) -> list[dict] | None:
        """The content as parts when it holds an image (``frontdoor`` reads them), else None."""
        if not isinstance(self.content, list) or all(isinstance(part, TextPart) for part in self.content):
            return None
        return [part.model_dump(exclude_none=True) for part in self.content]


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's: the request's own Jinja chat template (--trust-request-chat-template) and more template variables.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, lt=2**32)] | None = None
    logprobs: bool = False
    top_logprobs: UInt32 | None = None

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, body: Any) -> Any:
        return refuse_unsupported(body, CHAT_UNSUPPORTED)


class TokenizeRequest(CheckedModel):
    """vLLM's /tokenize: ``prompt`` text, or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(CheckedModel):
    model: str | None = None
    tokens: list[UInt32]
