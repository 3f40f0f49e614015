"""``POST /v1/embeddings`` (OpenAI's shape, with vLLM's extras): the body, its inputs through the front door as
pooling requests, and the answer with each vector as floats or base64 (little-endian float32, as OpenAI's).

Served by a pooling server only (``--runner pooling``); a generating server answers 400, as a pooling server does
to completions and chat (the front door's ``check_runner``).
"""

from __future__ import annotations

import base64
import sys
import time
import uuid
from array import array
from typing import Annotated, Any, Literal

from fastapi import Request
from pydantic import BaseModel, Field, model_validator

from kvgrid.v1 import common_pb2
from services.common.errors import InvalidArgument
from services.common.tracing import extract
from services.tokenizer.embedding import Embeddings, embed
from services.tokenizer.engine_client import EngineClient
from services.tokenizer.frontdoor import EngineRequest, FrontDoor, Prompt, TextPrompt, TokensPrompt
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.openai.protocol import CheckedModel, UInt32, refuse_unsupported
from services.tokenizer.request_metrics import RequestMetrics

# The client's names of the front door's fields.
_PUBLIC = {"pooling.dimensions": "dimensions", "pooling.pooling_type": "pooling_type"}
_UNSUPPORTED = {"truncate_prompt_tokens": ((None,), "prompt truncation")}


class EmbeddingRequest(CheckedModel):
    model: str | None = None
    input: str | list[str] | list[UInt32] | list[list[UInt32]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, lt=2**32)] | None = None
    user: str | None = None
    # vLLM's extras
    normalize: bool | None = None
    add_special_tokens: bool = True
    request_id: str | None = None
    # kvgrid's: the server's --pooling-type unless given
    pooling_type: Literal["last", "mean", "cls"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, body: Any) -> Any:
        return refuse_unsupported(body, _UNSUPPORTED)

    def prompts(self) -> list[Prompt]:
        """A string, a list of strings, a list of token ids, or a list of lists of them: one prompt each."""
        given = self.input
        if isinstance(given, str):
            return [TextPrompt(given, "input", self.add_special_tokens)]
        if given and all(isinstance(item, int) for item in given):
            return [TokensPrompt(list(given), "input")]
        return [
            TextPrompt(item, f"input[{i}]", self.add_special_tokens)
            if isinstance(item, str)
            else TokensPrompt(list(item), f"input[{i}]")
            for i, item in enumerate(given)
        ]

    def pooling(self) -> common_pb2.PoolingParams:
        params = common_pb2.PoolingParams(pooling_type=self.pooling_type or "", dimensions=self.dimensions or 0)
        if self.normalize is not None:
            params.normalize = self.normalize
        return params


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


async def prepare_embeddings(req: EmbeddingRequest, door: FrontDoor) -> tuple[str, list[EngineRequest]]:
    """The request id and one pooling request per input; InvalidArgument carries the client's field name."""
    request_id = uuid.uuid4().hex if req.request_id is None else req.request_id
    try:
        return request_id, await door.prepare_pooling_async(req.prompts(), req.pooling(), request_id)
    except InvalidArgument as exc:
        exc.public_field = _PUBLIC.get(exc.field, exc.field)
        raise


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """``base64``: the float32 values' little-endian bytes, base64-encoded (what OpenAI's clients decode)."""
    if encoding_format == "float":
        return vector
    values = array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


def render(request_id: str, model: str, result: Embeddings, encoding_format: str) -> EmbeddingResponse:
    return EmbeddingResponse(
        id=f"embd-{request_id}",
        created=int(time.time()),
        model=model,
        data=[EmbeddingData(embedding=encode(v, encoding_format), index=i) for i, v in enumerate(result.vectors)],
        usage=EmbeddingUsage(prompt_tokens=result.num_prompt_tokens, total_tokens=result.num_prompt_tokens),
    )


async def serve_embeddings(
    req: EmbeddingRequest, door: FrontDoor, engine: EngineClient, model: str, raw: Request, metrics: TokenizerMetrics
) -> EmbeddingResponse:
    with RequestMetrics(metrics, req.request_id or "") as tracked:
        request_id, prepared = await prepare_embeddings(req, door)
        parent = extract(raw.headers)
        result = await embed(engine, prepared, request_id=request_id, parent_context=parent, tracked=tracked)
    return render(request_id, model, result, req.encoding_format)
