"""Request bodies of the OpenAI-compatible API (with vLLM's extra sampling fields), as pydantic models.

Only types are checked here; ranges and limits are the gRPC API's checks (``validation``), so both APIs
reject the same values with the same messages. Unknown fields are ignored, as OpenAI's server does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

UInt32 = Annotated[int, Field(ge=0, lt=2**32)]
Int32 = Annotated[int, Field(ge=-(2**31), lt=2**31)]
MAX_N = 128


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: set one of these."""

    model_config = ConfigDict(populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingRequest(BaseModel):
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

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[UInt32] | list[list[UInt32]]
    logprobs: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Annotated[int, Field(ge=1, lt=2**32)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: ``prompt`` text, or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[UInt32]
