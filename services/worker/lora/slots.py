"""The device slot table of LoRA adapters: ``max_loras`` slots, least recently used out, over a host copy.

Every (layer, projection) holds one stacked pair on the device, A ``[max_loras, slices * R, in]`` and B
``[max_loras, out, slices * R]``; slot s of each is adapter s's factors (zeros where it targets nothing). Adapters
are keyed by (name, path), so an adapter unloaded and loaded again from another path is another adapter. The host
cache keeps up to ``max_cpu_loras`` fused adapters read from disk, least recently used out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch

from services.common.lora_adapters import LoraError
from services.worker.lora.adapter import LoraAdapter, ProjectionShape

AdapterKey = tuple[str, str]  # (name, path)
Loader = Callable[[str, str], LoraAdapter]  # (name, path) -> the adapter fused on the host


class LoraSlots:
    def __init__(
        self,
        max_loras: int,
        max_cpu_loras: int,
        projections: dict[str, ProjectionShape],
        num_layers: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        loader: Loader,
    ):
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.loader = loader
        self.stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(num_layers):
            for proj, shape in projections.items():
                cols = len(shape.slice_sizes) * max_rank
                a = torch.zeros(max_loras, cols, shape.in_features, dtype=dtype, device=device)
                b = torch.zeros(max_loras, sum(shape.slice_sizes), cols, dtype=dtype, device=device)
                self.stacks[(layer, proj)] = (a, b)
        self.resident: OrderedDict[AdapterKey, int] = OrderedDict()  # least recently used first
        self.host: OrderedDict[AdapterKey, LoraAdapter] = OrderedDict()
        self.num_loads = 0  # adapters copied to a device slot (for tests and the log)

    def adapter(self, key: AdapterKey) -> LoraAdapter:
        """The fused adapter from the host cache, read from disk when absent; raises LoraError."""
        found = self.host.get(key)
        if found is not None:
            self.host.move_to_end(key)
            return found
        adapter = self.loader(*key)
        self.host[key] = adapter
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return adapter

    def activate(self, keys: Iterable[AdapterKey]) -> dict[AdapterKey, int]:
        """Slots for one step's adapters, loading the missing ones over the least recently used slots that the
        step does not use. Raises LoraError when the step names more than ``max_loras`` adapters."""
        wanted = list(dict.fromkeys(keys))
        if len(wanted) > self.max_loras:
            raise LoraError(f"a step with {len(wanted)} adapters, over --max-loras {self.max_loras}")
        for key in wanted:
            if key in self.resident:
                self.resident.move_to_end(key)
        for key in wanted:
            if key not in self.resident:
                self._load(key, self._free_slot(set(wanted)))
        return {key: self.resident[key] for key in wanted}

    def _free_slot(self, keep: set[AdapterKey]) -> int:
        used = set(self.resident.values())
        for slot in range(self.max_loras):
            if slot not in used:
                return slot
        victim = next(k for k in self.resident if k not in keep)  # LRU order; activate bounds len(keep)
        return self.resident.pop(victim)

    def _load(self, key: AdapterKey, slot: int) -> None:
        adapter = self.adapter(key)
        for where, (a, b) in self.stacks.items():
            pair = adapter.weights.get(where)
            if pair is None:
                a[slot].zero_()
                b[slot].zero_()
            else:
                a[slot].copy_(pair[0])
                b[slot].copy_(pair[1])
        self.resident[key] = slot
        self.num_loads += 1
