"""Pooling requests (--runner pooling): which runner takes which request, the PoolingParams checks, the server's
defaults filled in. The frontend resolves a request's params once (``resolve``); the scheduler and the worker
take only resolved ones, so every side pools the same way."""

from __future__ import annotations

from kvgrid.v1 import common_pb2, worker_pb2
from services.common.errors import InvalidArgument

POOLING_TYPES = ("last", "mean", "cls")
# What each runner serves, vLLM's task names (ModelInfo.supported_tasks).
TASKS = {"generate": ["generate"], "pooling": ["embed", "encode"]}


def runner_of(info: worker_pb2.HandshakeResponse) -> str:
    return "pooling" if info.HasField("pooler") else "generate"


def check_runner(field: str, wants_pooling: bool, serves_pooling: bool) -> None:
    """A pooling request to a generating server, or a generation request to a pooling one: INVALID_ARGUMENT."""
    if wants_pooling and not serves_pooling:
        raise InvalidArgument(
            field, "this server runs the model for generation (--runner generate): it serves no embeddings"
        )
    if serves_pooling and not wants_pooling:
        raise InvalidArgument(
            field,
            "this server runs the model as an embedding model (--runner pooling): use /v1/embeddings or Embed, "
            "not completions or chat",
        )


def check_pooling_fields(params: common_pb2.PoolingParams, hidden_size: int = 0) -> None:
    """Each field in range (``hidden_size``: the vector's full length, 0 when unknown)."""
    if params.pooling_type and params.pooling_type not in POOLING_TYPES:
        raise InvalidArgument(
            "pooling.pooling_type", f"must be one of {', '.join(POOLING_TYPES)}, got {params.pooling_type!r}"
        )
    if hidden_size and params.dimensions > hidden_size:
        raise InvalidArgument(
            "pooling.dimensions", f"at most the model's hidden size {hidden_size}, got {params.dimensions}"
        )


def check_resolved(params: common_pb2.PoolingParams) -> None:
    """What the scheduler and the worker require: ``resolve``'s output."""
    check_pooling_fields(params)
    if not params.pooling_type or not params.HasField("normalize"):
        raise InvalidArgument("pooling", "pooling_type and normalize must be set (the frontend fills the defaults)")


def resolve(params: common_pb2.PoolingParams, pooler: worker_pb2.PoolerConfig) -> common_pb2.PoolingParams:
    """``params`` checked against the model, with the server's defaults in the fields left unset."""
    check_pooling_fields(params, pooler.hidden_size)
    return common_pb2.PoolingParams(
        pooling_type=params.pooling_type or pooler.pooling_type,
        normalize=params.normalize if params.HasField("normalize") else pooler.normalize,
        dimensions=params.dimensions,
    )
