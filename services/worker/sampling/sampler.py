"""Batched sampling over one step's logits: greedy, temperature, min-p / top-k / top-p, penalties,
per-request seeds and top-n logprobs.

Order per row (as vLLM): structured-output mask -> stop tokens banned until min_tokens -> penalties ->
temperature -> min-p -> top-k -> top-p -> sample. Logprobs are read after the mask, before the rest.
Greedy rows take the argmax of the penalised logits. Random rows use the exponential race:
argmax(probs / E) with E ~ Exp(1) i.i.d. per token, which picks token i with probability probs[i].
The noise of a seeded request's output token k comes from a generator seeded with mix(seed, k),
so its tokens depend only on the seed, the logits and the position: not on batch companions,
and not on whether the request was preempted and resumed.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvgrid.v1 import common_pb2
from services.worker.sampling.filters import apply_min_p, apply_top_k, apply_top_k_top_p
from services.worker.sampling.penalties import apply_penalties, gather_penalty_state, penalty_params
from services.worker.sampling.request_sampling import RequestSampling, device_tensor
from services.worker.sampling.structured import apply_token_masks

__all__ = ["RequestSampling", "Sampler", "SamplerOutput", "position_seed"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """Generator seed for output token ``position`` of a request seeded with ``seed`` (63 bits, torch-safe)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ position) >> 1


def _native_argmax(lib: ctypes.CDLL, logits: torch.Tensor) -> list[int]:
    """torch.argmax(logits.float(), -1) of float32 or bfloat16 CPU rows (the first maximum, or the first NaN),
    through the decode kernels' ``kvg_argmax_rows``, which widens bfloat16 as it reads."""
    if logits.dtype not in (torch.float32, torch.bfloat16):
        logits = logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    lib.kvg_set_num_threads(torch.get_num_threads())
    dtype = int(logits.dtype == torch.bfloat16)  # scalar.h's codes
    lib.kvg_argmax_rows(logits.data_ptr(), logits.stride(0), rows, vocab, out.data_ptr(), dtype)
    return out.tolist()


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per logits row
    logprobs: list[common_pb2.TokenLogprob | None]  # None for rows that asked for no logprobs


class Sampler:
    """Samples one token per logits row; row i belongs to ``requests[i]``.

    Unseeded requests share one generator, seeded from ``seed`` or else from the first
    ``default_seed`` a request carries (the worker's --seed); with neither it is seeded at random.
    ``cpu_kernels``: the native decode kernels when the model runs on them; greedy rows on the CPU
    then take their argmax.
    """

    def __init__(
        self, vocab_size: int, device: torch.device, seed: int | None = None, cpu_kernels: ctypes.CDLL | None = None
    ):
        self.vocab_size = vocab_size
        self.cpu_kernels = cpu_kernels
        self.device = torch.device(device)
        self._shared = torch.Generator(device=self.device)
        self._shared_seeded = seed is not None
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed & _MASK64)
        self._positional = torch.Generator(device=self.device)  # reseeded for every seeded row

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: list[RequestSampling]) -> SamplerOutput:
        """logits: [num_rows, >= vocab_size] in any float dtype; columns past vocab_size (padding) are ignored."""
        if logits.shape[0] != len(requests) or logits.shape[-1] < self.vocab_size:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(requests)} rows x {self.vocab_size}")
        logits = logits[:, : self.vocab_size]
        if all(r.plain_greedy for r in requests):
            # Hot path: one argmax over the batch. On CUDA it reads bf16 as is; on the CPU the
            # native kernel reads float32 or bf16 rows as they are (torch's CPU argmax is slower on bf16
            # than an upcast and its float32 one, and the native argmax beats both;
            # benchmarks/sampling_bench.py's greedy case times the upcast and torch's argmax: its Sampler
            # has no native kernels).
            if logits.device.type == "cpu":
                if self.cpu_kernels is not None:
                    return SamplerOutput(_native_argmax(self.cpu_kernels, logits), [None] * len(requests))
                logits = logits.float()
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(requests))
        return self._sample_full(logits.to(torch.float32, copy=True), requests)

    def _sample_full(self, logits: torch.Tensor, requests: list[RequestSampling]) -> SamplerOutput:
        logprob_rows = [i for i, r in enumerate(requests) if r.num_logprobs > 0]
        penalised_rows = [i for i, r in enumerate(requests) if r.penalised]
        banning_rows = [i for i, r in enumerate(requests) if r.bans_stop_tokens]
        random_rows = [i for i, r in enumerate(requests) if not r.greedy]
        constrained_rows = [i for i, r in enumerate(requests) if r.constraint is not None]

        if constrained_rows:
            apply_token_masks(logits, constrained_rows, [requests[i].constraint for i in constrained_rows])
        raw_logprobs = None  # [L, vocab]: log-softmax of the (masked) logits of the rows asking for logprobs
        if logprob_rows:
            raw_logprobs = torch.log_softmax(logits[self._index(logprob_rows)], dim=-1)
        if banning_rows:
            self._ban_stop_tokens(logits, [(i, requests[i].stop_token_ids) for i in banning_rows])
        if penalised_rows:
            index = self._index(penalised_rows)
            penalised = [requests[i] for i in penalised_rows]
            counts, prompt_mask = gather_penalty_state(penalised, self.vocab_size, self.device)
            any_repetition = any(r.repetition_penalty != 1.0 for r in penalised)
            params = penalty_params(penalised, self.device)
            logits[index] = apply_penalties(logits[index], counts, prompt_mask, params, any_repetition)

        if not random_rows:
            tokens = logits.argmax(dim=-1)  # [num_rows]
        elif len(random_rows) == len(requests):
            tokens = self._sample_random(logits, requests)
        else:
            tokens = logits.argmax(dim=-1)
            index = self._index(random_rows)
            tokens[index] = self._sample_random(logits[index], [requests[i] for i in random_rows])

        token_ids = tokens.tolist()
        logprobs: list[common_pb2.TokenLogprob | None] = [None] * len(requests)
        if raw_logprobs is not None:
            chosen = tokens[self._index(logprob_rows)]
            entries = _top_logprobs(raw_logprobs, chosen, requests, logprob_rows)
            for row, entry in zip(logprob_rows, entries, strict=True):
                logprobs[row] = entry
        return SamplerOutput(token_ids, logprobs)

    def _sample_random(self, logits: torch.Tensor, requests: list[RequestSampling]) -> torch.Tensor:
        """logits: [R, vocab] float32, the sampler's own copy (changed in place) -> sampled ids [R] int64."""
        probs = self._probs(logits, requests)
        return probs.div_(self._noise(logits.shape[0], logits.shape[1], requests)).argmax(dim=-1)

    @torch.inference_mode()
    def probs(self, logits: torch.Tensor, requests: list[RequestSampling]) -> torch.Tensor:
        """The distributions random rows sample from: [R, vocab] float32 after temperature, min-p, top-k and
        top-p (requests without penalties, stop-token bans or structured output: speculative verification)."""
        return self._probs(logits[:, : self.vocab_size].to(torch.float32, copy=True), requests)

    def generator(self, request: RequestSampling, offset: int = 0) -> torch.Generator:
        """The generator for ``request``'s output token ``num_output_tokens + offset``: seeded by position for a
        seeded request (valid until the next call), else the shared one."""
        if request.seed is None:
            self._seed_shared([request])
            return self._shared
        self._positional.manual_seed(position_seed(request.seed, request.num_output_tokens + offset))
        return self._positional

    def _probs(self, logits: torch.Tensor, requests: list[RequestSampling]) -> torch.Tensor:
        num_rows, vocab = logits.shape
        # columns: temperature, top_p (> 1 means off), min_p, top_k (vocab means off)
        values = [[r.temperature, r.top_p if r.top_p < 1.0 else 2.0, r.min_p, r.top_k or vocab] for r in requests]
        params = device_tensor(values, torch.float32, self.device)
        logits.div_(params[:, 0:1])
        if any(r.min_p > 0.0 for r in requests):
            apply_min_p(logits, params[:, 2])
        top_k = params[:, 3].long().clamp_(1, vocab)
        max_k = max((r.top_k for r in requests if 0 < r.top_k < vocab), default=0)
        if any(r.top_p < 1.0 for r in requests):
            logits = apply_top_k_top_p(logits, top_k, params[:, 1], max_k)
        elif max_k:
            apply_top_k(logits, top_k, max_k)
        return logits.softmax(dim=-1)

    def _noise(self, num_rows: int, vocab: int, requests: list[RequestSampling]) -> torch.Tensor:
        """Exp(1) noise [R, vocab] as -log(U), U ~ Uniform[0, 1): values in (0, inf], so probs / noise
        is never NaN. A seeded row's noise depends only on (seed, position, vocab)."""
        uniform = torch.empty(num_rows, vocab, dtype=torch.float32, device=self.device)
        seeded_rows = [row for row, r in enumerate(requests) if r.seed is not None]
        if len(seeded_rows) < num_rows:
            self._seed_shared(requests)
            if seeded_rows:
                unseeded = self._index([row for row, r in enumerate(requests) if r.seed is None])
                shape = (unseeded.numel(), vocab)
                uniform[unseeded] = torch.rand(shape, generator=self._shared, device=self.device)
            else:
                uniform.uniform_(generator=self._shared)
        for row in seeded_rows:
            r = requests[row]
            self._positional.manual_seed(position_seed(r.seed, r.num_output_tokens))
            uniform[row].uniform_(generator=self._positional)
        return uniform.log_().neg_()

    def _ban_stop_tokens(self, logits: torch.Tensor, banned: list[tuple[int, frozenset[int]]]) -> None:
        """Set logits[row, token] = -inf for each row's banned tokens (ids past the vocabulary ignored)."""
        pairs = [(row, t) for row, tokens in banned for t in tokens if 0 <= t < self.vocab_size]
        if pairs:
            rows, tokens = device_tensor(pairs, torch.long, self.device).unbind(1)
            logits[rows, tokens] = float("-inf")

    def _seed_shared(self, requests: list[RequestSampling]) -> None:
        if self._shared_seeded:
            return
        default_seed = next((r.default_seed for r in requests if r.default_seed is not None), None)
        if default_seed is not None:
            self._shared.manual_seed(default_seed & _MASK64)
            self._shared_seeded = True

    def _index(self, rows: list[int]) -> torch.Tensor:
        return device_tensor(rows, torch.long, self.device)


def _top_logprobs(
    raw_logprobs: torch.Tensor, chosen: torch.Tensor, requests: list[RequestSampling], rows: list[int]
) -> list[common_pb2.TokenLogprob]:
    """raw_logprobs [L, vocab], chosen [L] sampled ids -> one TokenLogprob per row, top-n best first."""
    max_n = min(max(requests[i].num_logprobs for i in rows), raw_logprobs.shape[-1])
    top_values, top_ids = raw_logprobs.topk(max_n, dim=-1)
    chosen_values = raw_logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    top_values, top_ids, chosen_values, chosen_ids = (
        top_values.tolist(),
        top_ids.tolist(),
        chosen_values.tolist(),
        chosen.tolist(),
    )
    entries = []
    for j, row in enumerate(rows):
        n = requests[row].num_logprobs
        pairs = zip(top_ids[j][:n], top_values[j][:n], strict=True)
        top = [common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in pairs]
        entries.append(common_pb2.TokenLogprob(token_id=chosen_ids[j], logprob=chosen_values[j], top=top))
    return entries
