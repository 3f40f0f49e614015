"""``LLM.embed`` and ``LLM.encode``: pooling requests (``runner="pooling"``) in the caller's process, with vLLM's
shapes: ``PoolingParams`` in, ``EmbeddingRequestOutput`` / ``PoolingRequestOutput`` out.

The inputs go through the frontend's ``FrontDoor.prepare_pooling`` (the server's defaults filled in, the same
checks and messages as ``/v1/embeddings``) and the scheduler core as prefill-only requests; the worker pools
each prompt as it finishes, exactly as the served stack does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvgrid.offline.engine import OfflineEngine
from kvgrid.offline.progress import Progress
from kvgrid.v1 import common_pb2
from services.scheduler.request import Request


@dataclass(slots=True)
class PoolingParams:
    """How a prompt becomes one vector; None takes the LLM's defaults (``pooling_type``, ``normalize``)."""

    pooling_type: str | None = None  # "last", "mean" or "cls"
    normalize: bool | None = None
    dimensions: int | None = None  # Matryoshka truncation: the first ``dimensions`` values

    def to_proto(self) -> common_pb2.PoolingParams:
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"pooling.dimensions: must be >= 1, got {self.dimensions}")
        params = common_pb2.PoolingParams(pooling_type=self.pooling_type or "", dimensions=self.dimensions or 0)
        if self.normalize is not None:
            params.normalize = self.normalize
        return params


@dataclass(slots=True)
class PoolingOutput:
    data: torch.Tensor  # [dimensions] float32


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(slots=True)
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


def run_pooling(engine: OfflineEngine, requests: Sequence[Request], use_tqdm: bool = True) -> list[list[float]]:
    """Run pooling requests to the end; their vectors in the order given."""
    pending = deque(requests)
    index = {r.request_id: i for i, r in enumerate(requests)}
    vectors: list[list[float] | None] = [None] * len(requests)
    live: set[str] = set()
    progress = Progress(len(requests), use_tqdm)
    try:
        while pending or engine.has_work():
            while pending and engine.scheduler.num_waiting < engine.admission.max_waiting_requests:
                request = pending.popleft()
                live.add(request.request_id)
                engine.add(request)
            for out in engine.step():
                if out.pooled is not None:
                    rid = out.request.request_id
                    vectors[index[rid]] = list(out.pooled)
                    live.discard(rid)
                    progress.done(out.request.num_prompt_tokens, 0)
    finally:
        for rid in live:  # interrupted: leave nothing behind for the next call
            engine.abort(rid)
        progress.close()
    return vectors
