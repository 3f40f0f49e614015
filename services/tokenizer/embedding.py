"""Pooling requests through the engine: one per input, submitted together, each answered by one vector.

Used by the gRPC ``Embed`` servicer and ``/v1/embeddings`` alike. The scheduler batches the inputs with
whatever else runs (prefill only, chunked like any prompt); each request's one delta carries its vector.
Leaving early (an error, a cancelled call) aborts the inputs still running upstream.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.trace import Status, StatusCode

from kvgrid.v1 import common_pb2
from services.common.errors import Aborted, Unavailable
from services.common.tracing import inject, tracer
from services.tokenizer.engine_client import EngineClient
from services.tokenizer.frontdoor import EngineRequest
from services.tokenizer.request_handle import RequestHandle
from services.tokenizer.request_metrics import RequestMetrics


@dataclass(slots=True)
class Embeddings:
    vectors: list[list[float]]  # one per input, in input order
    num_prompt_tokens: int  # the inputs' tokens together


async def embed(
    engine: EngineClient,
    requests: list[EngineRequest],
    *,
    request_id: str = "",
    parent_context=None,
    tracked: RequestMetrics | None = None,
) -> Embeddings:
    """Run ``FrontDoor.prepare_pooling``'s requests (``request_id``: theirs, for the metrics and the log); raises
    KvgridError subclasses."""
    num_tokens = sum(len(r.prompt_ids) for r in requests)
    if tracked is not None:
        tracked.begin(request_id, num_tokens)
    span = tracer().start_span(
        "tokenizer.embed",
        context=parent_context,
        attributes={"kvgrid.num_inputs": len(requests), "kvgrid.prompt_tokens": num_tokens},
    )
    handles: list[RequestHandle] = []
    try:
        for r in requests:
            handles.append(await engine.submit(r.request_id, r.prompt_ids, r.sampling, inject(span), r.pooling))
        vectors = [await _vector(handle) for handle in handles]
        if tracked is not None:
            tracked.finish("stop")
    except BaseException as e:
        span.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
        raise
    finally:
        for handle in handles:
            if not handle.done_upstream:
                handle.close()
        span.end()
    return Embeddings(vectors, num_tokens)


async def _vector(handle: RequestHandle) -> list[float]:
    async for delta in handle:
        if delta.finish_reason == common_pb2.FINISH_REASON_ABORT:
            raise Aborted(f"request {handle.request_id!r} was aborted")
        if delta.finish_reason:
            return list(delta.embedding)
    raise Unavailable(f"the scheduler ended request {handle.request_id!r} without its vector")
