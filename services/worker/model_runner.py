"""One step: request states -> flat batch tensors (built once) -> forward -> logits of sampling rows -> tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvgrid.v1 import common_pb2
from services.worker.attention.base import AttentionMetadata
from services.worker.cuda_graphs import DecodeGraphs, capture_sizes
from services.worker.lora.manager import LoraManager
from services.worker.models.llama import LlamaForCausalLM
from services.worker.multimodal.encoder_cache import EncoderCache
from services.worker.multimodal.inputs import ImageSlice, step_slices
from services.worker.pooling import pool_step
from services.worker.request_state import RequestState
from services.worker.sampling.prompt_logprobs import PromptRows
from services.worker.sampling.request_sampling import RequestSampling
from services.worker.sampling.sampler import Sampler
from services.worker.spec_decode.decoder import SpecDecoder


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [R] int64, the last row of each request that samples
    sampling_requests: list[RequestState]  # row i of the logits belongs to sampling_requests[i]
    batch: list[RequestState]  # in the order of the flat batch (decodes first)
    prompt_rows: PromptRows | None = None  # rows that score prompt tokens (SamplingParams.prompt_logprobs)
    has_pooling: bool = False  # some request pools its hidden states (a pooling worker's steps)
    image_slices: list[ImageSlice] | None = None  # encoder rows that replace placeholder tokens' embeddings
    # Rows verifying proposals: their logits follow the sampling rows', num_drafts + 1 each, in this order.
    spec_requests: list[RequestState] = field(default_factory=list)


@dataclass(slots=True)
class SampledRow:
    request: RequestState
    token_id: int
    logprob: common_pb2.TokenLogprob | None
    pooled: list[float] | None = None  # a pooling request's vector (its prompt is done; token_id means nothing)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        sampler: Sampler,
        device: torch.device,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sampler = sampler
        self.device = torch.device(device)
        self.graphs: DecodeGraphs | None = None  # decode steps replayed from CUDA graphs, see use_decode_graphs
        # Tensor parallel: gets each step's inputs before the forward, to run it on the other ranks too.
        self.step_listener: Callable[[StepInputs], None] | None = None
        # A vision-language model's encoder outputs (see use_encoder_cache); None for a text model.
        self.encoder_cache: EncoderCache | None = None
        self.spec: SpecDecoder | None = None  # speculative decoding (--speculative-config)
        self.lora: LoraManager | None = None  # --enable-lora: maps each step's rows to their adapters

    def use_encoder_cache(self, max_bytes: int) -> None:
        """Steps whose tokens include image placeholders take the model's encoder outputs there."""
        self.encoder_cache = EncoderCache(self.model.encode_images, self.device, max_bytes)

    def use_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool = True) -> None:
        """Decode steps of up to ``max_num_seqs`` requests through ``DecodeGraphs``; ``capture`` on CUDA
        only (without it the same static buffers run eagerly, which is how tests check them on CPU)."""
        self.graphs = DecodeGraphs(
            self.model, self.kv_caches, self.block_size, max_model_len, capture_sizes(max_num_seqs), self.device
        )
        if capture:
            self.graphs.capture()

    @property
    def num_blocks(self) -> int:
        return self.kv_caches[0][0].shape[0]

    def prepare(self, requests: list[RequestState]) -> StepInputs:
        """Python lists first, one tensor each at the end. Decodes go first: the torch attention
        backend batches the leading run of single-token requests."""
        # Within each part, requests of one LoRA adapter are adjacent: its rows form one run (see lora/apply.py).
        batch = sorted(requests, key=lambda r: (r.num_scheduled_tokens != 1, r.lora or ()))
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_indices: list[int] = []
        sampling_requests: list[RequestState] = []
        prompt_rows = PromptRows()
        has_pooling = False
        image_slices: list[ImageSlice] = []
        spec_indices: list[int] = []
        spec_requests: list[RequestState] = []
        for r in batch:
            start, end = r.num_computed_tokens, r.num_computed_tokens + r.num_scheduled_tokens
            blocks = r.block_ids
            if r.mm_inputs:
                image_slices += step_slices(r.mm_inputs, start, end, len(input_ids))
            if r.prompt_logprobs >= 0:
                prompt_rows.add(r, len(input_ids), start, end)
            input_ids += r.token_ids[start:end]
            positions += range(start, end)
            slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            tables.append(blocks[: -(-end // bs)])
            if r.pooling is not None:
                has_pooling = True
            elif r.num_drafts:
                spec_indices += range(len(input_ids) - r.num_drafts - 1, len(input_ids))
                spec_requests.append(r)
            elif r.samples_this_step:
                logits_indices.append(len(input_ids) - 1)
                sampling_requests.append(r)
        width = max(len(t) for t in tables)
        query_lens = [r.num_scheduled_tokens for r in batch]
        if self.lora is not None:
            self.lora.prepare([r.lora for r in batch], query_lens)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=meta,
            logits_indices=torch.tensor(logits_indices + spec_indices, dtype=torch.int64, device=dev),
            sampling_requests=sampling_requests,
            batch=batch,
            prompt_rows=prompt_rows or None,
            has_pooling=has_pooling,
            image_slices=image_slices or None,
            spec_requests=spec_requests,
        )

    @torch.inference_mode()
    def compute_logits(self, inputs: StepInputs) -> torch.Tensor:  # [R, vocab]
        return self.forward(inputs)[0]

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> tuple[torch.Tensor, list[SampledRow]]:
        """The logits of the sampling rows, and the vectors of the pooling requests whose prompt this step ends."""
        if self.step_listener is not None:
            self.step_listener(inputs)
        graphs, meta = self.graphs, inputs.meta
        prompt_rows = inputs.prompt_rows
        if (
            graphs is not None
            and prompt_rows is None
            and graphs.takes(meta)
            and len(inputs.sampling_requests) == meta.num_seqs
        ):
            return graphs.run(inputs.input_ids, inputs.positions, meta), []  # every row samples, in batch order
        if inputs.image_slices is None:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)  # [T, E]
        else:
            if self.encoder_cache is None:
                raise ValueError("a request has images but the model takes text only")
            embeds = self.encoder_cache.embed(self.model.embed_tokens.forward(inputs.input_ids), inputs.image_slices)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, inputs_embeds=embeds)
        return self.outputs(inputs, hidden)

    def outputs(self, inputs: StepInputs, hidden: torch.Tensor) -> tuple[torch.Tensor, list[SampledRow]]:
        """``forward``'s result from the model's output ``hidden`` [T, E]."""
        prompt_rows, meta = inputs.prompt_rows, inputs.meta
        if prompt_rows is not None:
            prompt_rows.compute(self.model.compute_logits, hidden)
        pooled = []
        if inputs.has_pooling:
            rows = pool_step(self.model.norm, hidden, inputs.batch, meta.query_lens_cpu)
            pooled = [SampledRow(row.request, 0, None, row.data) for row in rows]
            if not inputs.sampling_requests and not inputs.spec_requests:
                return hidden[:0], pooled
        return self.model.compute_logits(hidden[inputs.logits_indices]), pooled

    def execute(self, requests: list[RequestState]) -> list[SampledRow]:
        """Run one step and commit it: computed counts advance, sampled tokens join their requests."""
        if not requests:
            return []
        if self.spec is not None:
            self.spec.propose(requests)
        inputs = self.prepare(requests)
        logits, pooled = self.forward(inputs)
        return self.commit(requests, inputs, logits, pooled)

    def commit(
        self, requests: list[RequestState], inputs: StepInputs, logits: torch.Tensor, pooled: list[SampledRow]
    ) -> list[SampledRow]:
        """Samples the step's ``logits`` and commits it (``execute``'s end)."""
        rows: list[SampledRow] = []
        num_sampling = len(inputs.sampling_requests)
        if num_sampling:
            with torch.inference_mode():
                out = self.sampler(logits[:num_sampling], [r.sampling for r in inputs.sampling_requests])
            rows = [
                SampledRow(r, token, lp)
                for r, token, lp in zip(inputs.sampling_requests, out.token_ids, out.logprobs, strict=True)
            ]
        for r in requests:
            r.num_computed_tokens += r.num_scheduled_tokens
            r.num_scheduled_tokens = 0
        if inputs.spec_requests:
            emitted = self.spec.verify(logits[num_sampling:], inputs.spec_requests, self.sampler)
            for r, tokens in zip(inputs.spec_requests, emitted, strict=True):
                rows += [SampledRow(r, token, None) for token in tokens]
        for row in rows:
            row.request.token_ids.append(row.token_id)
            row.request.sampling.append(row.token_id)
        return rows + pooled

    def execute_steps(self, requests: list[RequestState], num_steps: int) -> list[SampledRow]:
        """``execute`` ``num_steps`` times over a batch of decodes that all sample: each step computes the token
        the step before sampled (a plan of several steps, see StepPlan.num_steps). Rows in step order. Fewer
        steps once every request has sampled a stop token, in this plan or one before (a plan already in flight
        when it stopped): the scheduler drops what the rest would sample. The first step always runs: it computes
        the K/V of the token sampled last, which the scheduler may have registered for prefix reuse."""
        rows = self.execute(requests)
        for _ in range(num_steps - 1):
            if all(r.sampling.stopped for r in requests):
                break
            for r in requests:
                r.num_scheduled_tokens = 1
            rows += self.execute(requests)
        return rows

    def profile_run(self, num_tokens: int, num_seqs: int) -> None:
        """A dummy step of ``num_tokens`` prompt tokens over ``num_seqs`` requests that all sample.

        The cache must hold ``profile_cache_blocks(num_tokens, num_seqs, block_size)`` blocks."""
        num_seqs = max(1, min(num_seqs, num_tokens))
        per_seq, extra = divmod(num_tokens, num_seqs)
        next_block = 0
        requests = []
        for i in range(num_seqs):
            n = per_seq + (1 if i < extra else 0)
            num_blocks = -(-n // self.block_size)
            requests.append(
                RequestState(
                    request_id=f"profile-{i}",
                    token_ids=[0] * n,
                    num_prompt_tokens=n,
                    block_ids=list(range(next_block, next_block + num_blocks)),
                    num_computed_tokens=0,
                    sampling=RequestSampling.create(common_pb2.SamplingParams(), [0] * n, []),
                    num_scheduled_tokens=n,
                )
            )
            next_block += num_blocks
        self.execute(requests)


def profile_cache_blocks(num_tokens: int, num_seqs: int, block_size: int) -> int:
    """Blocks the dummy step of ``ModelRunner.profile_run`` touches."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    longest = -(-num_tokens // num_seqs)
    return num_seqs * -(-longest // block_size)
