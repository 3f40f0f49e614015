"""kvgrid: an LLM serving system split into tokenizer, scheduler and worker services.

``from kvgrid import LLM, SamplingParams`` runs it offline in this process (see ``kvgrid.offline``).
The names load on first use: the services import this package and must not pull in torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "LLM": "kvgrid.offline.llm",
    "SamplingParams": "kvgrid.offline.sampling_params",
    "LoRARequest": "kvgrid.offline.lora_request",
    "RequestOutput": "kvgrid.offline.outputs",
    "PoolingParams": "kvgrid.offline.pooling",
    "EmbeddingRequestOutput": "kvgrid.offline.pooling",
    "PoolingRequestOutput": "kvgrid.offline.pooling",
}
__all__ = [
    "LLM",
    "EmbeddingRequestOutput",
    "LoRARequest",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvgrid' has no attribute {name!r}")
