"""The worker's LoRA state: the slot table and the step's row map, built from the config and attached to a model.

The scheduler plans at most ``--max-loras`` distinct adapters per step (announced in the handshake), so each step's
adapters fit the slots; the worker loads the ones missing itself (from the path each request carries), least
recently used slots first. The native CPU path (models/llama_cpu.py) computes whole layers in C and has no LoRA
products, so with ``--enable-lora`` steps run on the torch path; CUDA graphs are off too (the row map changes per
step).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from services.common.errors import InvalidArgument
from services.common.lora_adapters import LoraError
from services.worker.lora.adapter import load_adapter, model_projections
from services.worker.lora.apply import LoraBatch, attach_lora
from services.worker.lora.slots import AdapterKey, LoraSlots

log = logging.getLogger(__name__)


class LoraManager:
    def __init__(self, slots: LoraSlots, batch: LoraBatch, device: torch.device):
        self.slots = slots
        self.batch = batch
        self.device = device

    @property
    def max_loras(self) -> int:
        return self.slots.max_loras

    def prepare(self, adapters: Sequence[AdapterKey | None], query_lens: Sequence[int]) -> None:
        """The step's row map: request i (its ``query_lens[i]`` rows, in flat-batch order) runs ``adapters[i]``.

        An adapter the worker cannot read (its files changed since the frontend checked them, or it was trained on
        another base model) fails the step with INVALID_ARGUMENT naming it: the scheduler then fails the step's
        requests rather than resuming them on the next stream."""
        try:
            slot_of = self.slots.activate(a for a in adapters if a is not None)
        except LoraError as exc:
            raise InvalidArgument("lora", str(exc)) from None
        rows: list[int] = []
        for adapter, n in zip(adapters, query_lens, strict=True):
            rows += [-1 if adapter is None else slot_of[adapter]] * n
        self.batch.set(rows, self.device)


def build_lora_manager(model, max_loras: int, max_cpu_loras: int, max_rank: int) -> LoraManager:
    """Slots for ``model`` (a Llama-family model already on its device), its projections made LoRA-aware."""
    a = model.args
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    projections = model_projections(a.hidden_size, a.intermediate_size, q, kv)
    weight = model.embed_tokens.weight
    dtype, device = weight.dtype, weight.device

    def loader(name: str, path: str):
        adapter = load_adapter(name, path, projections, a.num_layers, max_rank, dtype)
        log.info("LoRA adapter %r (rank %d, %.1f MiB) read from %s", name, adapter.rank, adapter.nbytes / 2**20, path)
        return adapter

    slots = LoraSlots(max_loras, max_cpu_loras, projections, a.num_layers, max_rank, dtype, device, loader)
    batch = LoraBatch()
    count = attach_lora(model, slots, batch)
    log.info("LoRA: %d slots of rank %d over %d projections", max_loras, max_rank, count)
    return LoraManager(slots, batch, device)
