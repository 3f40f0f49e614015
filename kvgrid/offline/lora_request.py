"""``LoRARequest``: vLLM's handle on a LoRA adapter for ``LLM.generate(..., lora_request=...)`` and ``LLM.chat``."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvgrid.v1 import common_pb2
from services.common.lora_adapters import LoraError, check_rank, read_config


@dataclass(slots=True, frozen=True)
class LoRARequest:
    """A PEFT adapter directory under a name (vLLM's order: name, int id, path). ``lora_int_id`` is kept for vLLM's
    signature; the name identifies the adapter (its KV blocks, its slot)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def to_proto(self, max_rank: int) -> common_pb2.LoraRequest:
        """Checked (config, files, rank); raises ValueError for an adapter the worker cannot serve."""
        if not self.lora_name:
            raise ValueError("lora_request: lora_name must not be empty")
        path = os.path.abspath(self.lora_path)
        try:
            check_rank(read_config(path), max_rank, path)
        except LoraError as exc:
            raise ValueError(f"lora_request {self.lora_name}: {exc}") from None
        return common_pb2.LoraRequest(name=self.lora_name, path=path)
