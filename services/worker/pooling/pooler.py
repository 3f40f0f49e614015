"""A pooling request's hidden states -> one vector, across the steps that compute its prompt.

The hidden states pooled are the model's last layer after its final norm (transformers' ``last_hidden_state``,
vLLM's pooler input). A prompt prefilled in chunks keeps its partial state between steps, here on the worker:
the running float32 sum for ``mean``, the first token's state for ``cls``; ``last`` needs only the final chunk.
Only the finished vector crosses the wire (``StepResult.pooled``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvgrid.v1 import common_pb2

if TYPE_CHECKING:
    from services.worker.request_state import RequestState


@dataclass(slots=True)
class PoolingState:
    """One pooling request's resolved parameters and what its computed chunks left behind."""

    pooling_type: str
    normalize: bool
    dimensions: int  # 0: all
    partial: torch.Tensor | None = None  # [E] float32: the running sum (mean) or the first token's state (cls)

    @classmethod
    def from_proto(cls, params: common_pb2.PoolingParams) -> PoolingState:
        return cls(params.pooling_type, params.normalize, params.dimensions)

    def add(self, normed: torch.Tensor, start: int) -> None:  # normed: [n, E], prompt positions start..start+n-1
        if self.pooling_type == "mean":
            chunk = normed.float().sum(dim=0)
            self.partial = chunk if self.partial is None else self.partial.add_(chunk)
        elif self.pooling_type == "cls" and start == 0:
            self.partial = normed[0].float()

    def finish(self, normed: torch.Tensor, num_prompt_tokens: int) -> torch.Tensor:  # [E'] float32
        """The vector, once the chunk ``normed`` (already ``add``-ed) computed the prompt's last token."""
        if self.pooling_type == "last":
            vector = normed[-1].float()
        elif self.pooling_type == "mean":
            vector = self.partial / num_prompt_tokens
        else:
            vector = self.partial
        if self.dimensions:
            vector = vector[: self.dimensions]
        if self.normalize:
            vector = F.normalize(vector, p=2, dim=0)
        return vector


@dataclass(slots=True)
class PooledRow:
    request: RequestState
    data: list[float]


def pool_step(norm, hidden: torch.Tensor, batch: Sequence[RequestState], query_lens: Sequence[int]) -> list[PooledRow]:
    """Feed each pooling request of a step its rows of ``hidden`` ([T, E], before the final norm ``norm``, in
    ``batch`` order); the requests whose prompt this step completes get their vector. Call before the step's
    computed counts advance."""
    rows = []
    offset = 0
    for request, n in zip(batch, query_lens, strict=True):
        state = request.pooling
        if state is not None:
            normed, _ = norm(hidden[offset : offset + n])
            state.add(normed, request.num_computed_tokens)
            if request.samples_this_step:
                rows.append(PooledRow(request, state.finish(normed, request.num_prompt_tokens).tolist()))
        offset += n
    return rows
