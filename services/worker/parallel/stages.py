"""Pipeline stages: the decoder layers split into P contiguous ranges, each stage's ranks holding only theirs.

A stage's model is the family's model built with its own layer count (and those layers' windows), its
checkpoint tensors renamed ``layers.{i}`` -> ``layers.{i - start}``; its KV cache has one pair per layer it
holds. Every stage loads the embedding, final norm and logits head (the memory profile runs a whole step on
each rank alone); then only stage 0 keeps the embedding and only rank 0, which computes logits, the head.

Between stages travels one tensor per step, [T, E]: the last layer's output plus its residual. The next
layer's fused add-and-norm would compute that very sum, so a stage starts from it with no residual and the
arithmetic is the same as one rank's. The last stage sends its output back to rank 0, which samples.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from services.worker.attention.base import AttentionMetadata
from services.worker.models.llama import LlamaArgs, LlamaForCausalLM
from services.worker.parallel.group import DistGroup, Layout

# Families whose model runs LlamaForCausalLM.forward with per-layer state only in LlamaArgs.layer_windows.
STAGED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_LAYER = re.compile(r"^((?:model\.)?layers\.)(\d+)\.")


def layer_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """[start, end) of each stage: equal shares, the extra layers on the last stages (stage 0 also samples)."""
    if num_stages > num_layers:
        raise ValueError(f"--pipeline-parallel-size {num_stages} exceeds the model's {num_layers} layers")
    share, extra = divmod(num_layers, num_stages)
    sizes = [share + (1 if s >= num_stages - extra else 0) for s in range(num_stages)]
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [(start, start + n) for start, n in zip(starts, sizes, strict=True)]


def check_stages(model_type: str, args: LlamaArgs, num_stages: int) -> None:
    """Raises ValueError with a one-line reason when this model cannot be split into ``num_stages``."""
    if model_type not in STAGED_MODEL_TYPES:
        raise ValueError(
            f"--pipeline-parallel-size {num_stages}: {model_type} models run in one stage"
            f" (stages split {', '.join(STAGED_MODEL_TYPES)} models)"
        )
    layer_ranges(args.num_layers, num_stages)


def stage_args(args: LlamaArgs, layers: tuple[int, int]) -> LlamaArgs:
    start, end = layers
    windows = args.layer_windows[start:end] if args.layer_windows else ()
    return dataclasses.replace(args, num_layers=end - start, layer_windows=windows)


def stage_weights(
    weights: Iterable[tuple[str, torch.Tensor]], layers: tuple[int, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The stage's layers' tensors, renumbered from 0, and every tensor outside the layers."""
    start, end = layers
    for name, tensor in weights:
        m = _LAYER.match(name)
        if m is None:
            yield name, tensor
        elif start <= int(m.group(2)) < end:
            yield f"{m.group(1)}{int(m.group(2)) - start}.{name[m.end() :]}", tensor


def drop_unused_weights(model: LlamaForCausalLM, layout: Layout) -> int:
    """After the memory plan: free the embedding on ranks past stage 0 and the logits head (and its float32 or
    packed copies) on every rank but 0, which alone computes logits. Returns the bytes freed."""
    freed = 0

    def empty(module: nn.Module) -> None:
        nonlocal freed
        freed += module.weight.numel() * module.weight.element_size()
        module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)
        module.packed = None
        for copy in ("weight_f32", "gemm"):  # a Linear's float32 and packed-GEMM copies
            if getattr(module, copy, None) is not None:
                setattr(module, copy, None)

    if layout.rank != 0:
        if model.lm_head is not None:
            empty(model.lm_head)
        model.logits_weight_f32 = model.logits_gemm = None
    if not layout.first:
        empty(model.embed_tokens)
    return freed


@dataclass(frozen=True, slots=True)
class BusyQuery:
    """A control message: each rank writes its stage's ``busy_s`` under ``{key}/{rank}`` in the rendezvous store."""

    key: str


class StagedModel:
    """One rank's stage in place of the model: receives the previous stage's hidden states, runs its layers,
    sends them on. On rank 0 a call returns the last stage's output, so the runner computes logits as usual;
    on the other ranks it returns what the stage computed."""

    def __init__(self, model: LlamaForCausalLM, group: DistGroup):
        self.model, self.group = model, group
        self.hidden_size = model.args.hidden_size
        self.dtype = model.embed_tokens.weight.dtype
        # Seconds this stage spent computing its layers (not waiting for or sending hidden states); on CUDA the
        # time to queue the kernels. Read by benchmarks/pp_bench.py through Ranks.stage_busy.
        self.busy_s = 0.0
        self._sending: list[tuple] = []  # (work, tensor) of the sends not known complete: the tensors stay alive
        self._last: torch.Tensor | None = None

    def __getattr__(self, name: str):  # compute_logits, norm, args, ... of the wrapped model
        return getattr(self.model, name)

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # this stage's layers
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, E]
        num_tokens = self.start(input_ids, positions, kv_caches, meta)
        return self.finish(num_tokens)

    def start(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> int:
        """Runs this stage's layers on the step and starts sending the output on; returns the step's token count.

        Sends never block (``isend``): a stage may be sending one micro-batch on while the next stage, or rank 0,
        still works on an earlier one. Only receives wait, and each waits on an earlier step, so ranks never wait
        on each other in a cycle."""
        layout, group = self.group.layout, self.group
        shape = (input_ids.shape[0], self.hidden_size)
        hidden = None if layout.first else group.recv(shape, self.dtype, layout.prev_rank)
        started = time.perf_counter()
        out = self.model(input_ids, positions, kv_caches, meta, hidden)
        self.busy_s += time.perf_counter() - started
        self._last = out
        if not layout.last:
            self._send(out, layout.next_rank)
        elif layout.tp_rank == 0 and layout.rank != 0:
            self._send(out, 0)
        return shape[0]

    def finish(self, num_tokens: int) -> torch.Tensor:  # [T, E]
        """The step's output: on rank 0 the last stage's (received now: steps come back in the order they
        started), elsewhere what this stage computed."""
        layout = self.group.layout
        if layout.rank == 0 and not layout.last:
            return self.group.recv((num_tokens, self.hidden_size), self.dtype, (layout.pp - 1) * layout.tp)
        return self._last

    def _send(self, out: torch.Tensor, dst: int) -> None:
        out = out.contiguous()
        self._sending = [(w, x) for w, x in self._sending if not w.is_completed()]
        self._sending.append((self.group.isend(out, dst), out))
