"""Decode steps replayed from CUDA graphs: one graph per padded batch size, captured at start-up.

A decode step of a small model is a few hundred short kernel launches; on a GPU their launch
overhead, not the math, sets the step time. Capturing the forward pass (embedding to logits) once
per batch size and replaying it turns those launches into one.

A graph reads and writes fixed addresses, so every input lives in a static buffer sized for the
largest captured batch and a step copies its own values in (device to device: the runner already
built them on the device). A step of ``n`` requests replays the smallest graph of ``>= n`` rows;
the padding rows get slot -1 (the KV-cache write skips them), context length 1 and block 0, and
their logits are dropped. Block tables are padded to the model's maximum length, so any context
fits; columns past a request's blocks are never read. Only the Triton backend qualifies: the
torch backend plans on host lists, which a graph would freeze at capture.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from services.worker.attention.base import AttentionMetadata
from services.worker.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

PAD_SLOT = -1


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64 and of 32 beyond, capped at ``max_num_seqs``."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(96, 1025, 32)]
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


class DecodeGraphs:
    """Replays decode-only steps of up to ``max(sizes)`` requests; ``capture=False`` runs the same
    static-buffer path eagerly (for tests on machines without CUDA)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_model_len: int,
        sizes: list[int],
        device: torch.device,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(set(sizes))
        self.max_blocks = -(-max_model_len // block_size)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)  # [N]
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)  # [N]
        self.slot_mapping = torch.full((n,), PAD_SLOT, dtype=torch.int64, device=device)  # [N]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)  # [N]
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # [N + 1], one token each
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)  # [N, max_blocks]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # [size, vocab] outputs of each graph
        self.pool = None

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_blocks,  # not read by the Triton kernels; an upper bound
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[1] * size,
        )

    @torch.inference_mode()
    def _forward(self, size: int) -> torch.Tensor:  # [size, vocab]
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self._meta(size))
        return self.model.compute_logits(hidden)

    def capture(self) -> None:
        """Largest first, sharing one memory pool (smaller graphs reuse the larger ones' blocks)."""
        started = time.perf_counter()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward(size)  # compiles the Triton kernels for this shape outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.logits[size] = self._forward(size)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info(
            "captured CUDA graphs for decode batches of %s requests in %.1fs",
            ",".join(map(str, self.sizes)),
            time.perf_counter() - started,
        )

    def takes(self, meta: AttentionMetadata) -> bool:
        return meta.is_decode_only and meta.num_seqs <= self.sizes[-1] and meta.block_tables.shape[1] <= self.max_blocks

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [n, vocab] of a decode-only step of n requests (``takes(meta)`` must hold)."""
        n = meta.num_seqs
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if size > n:  # rows a previous, larger step left behind become padding again
            self.slot_mapping[n:size].fill_(PAD_SLOT)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size, 0].fill_(0)
        graph = self.graphs.get(size)
        if graph is None:  # not captured: the eager path over the same buffers
            return self._forward(size)[:n]
        graph.replay()
        return self.logits[size][:n]
