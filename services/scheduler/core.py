"""One worker session's scheduler and the bookkeeping of each step: the contract every step loop calls.

A step is ``plan()``, then the loop runs the plan on the worker (over gRPC, or in process), then
``finish_step()`` with what the worker answered. Both the gRPC step loop (``engine.Engine``) and the offline
engine (``kvgrid.offline.engine``) drive a ``SchedulerCore`` this way, so what a step counts and records
(steps, plan timing for ``--num-scheduler-steps``, failed KV tier loads, the tokens, the metrics) is written
once, here.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvgrid.v1 import worker_pb2
from services.common.config import Config
from services.scheduler.admission import AdmissionLimits
from services.scheduler.block_pool import BlockPool
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.kv_tiers import build_tiers
from services.scheduler.lookahead import Lookahead
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.prompt_logprobs import PromptLogprobsChunk
from services.scheduler.scheduler import Scheduler, SchedulerLimits
from services.scheduler.step_plan import RequestOutput, SchedulerOutput


@dataclass(slots=True)
class StepCounters:
    """Counters since a core was built; ``+`` sums sessions."""

    num_steps: int = 0  # a plan of several decode steps counts as that many
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found

    def __add__(self, other: StepCounters) -> StepCounters:
        return StepCounters(
            self.num_steps + other.num_steps,
            self.num_preemptions + other.num_preemptions,
            self.prefix_cache_queries + other.prefix_cache_queries,
            self.prefix_cache_hits + other.prefix_cache_hits,
        )


class SchedulerCore:
    """The scheduler, the limits a Submit is admitted under, and the step count of one worker's block pool.

    Loops add and abort requests on ``scheduler`` directly; each step goes through ``plan``/``finish_step``.
    """

    def __init__(self, scheduler: Scheduler, admission: AdmissionLimits, metrics: SchedulerMetrics | None = None):
        self.scheduler = scheduler
        self.admission = admission
        self.metrics = metrics
        self.num_steps = 0

    @classmethod
    def for_worker(
        cls, info: worker_pb2.HandshakeResponse, config: Config, metrics: SchedulerMetrics | None = None
    ) -> SchedulerCore:
        """A fresh scheduler over a fresh pool of the worker's blocks, with the tighter of both sides' limits."""
        pool_tokens = info.num_blocks * info.block_size
        max_model_len = min((n for n in (info.max_model_len, config.model.max_model_len) if n > 0), default=pool_tokens)
        sched = config.scheduler
        limits = SchedulerLimits(
            max_num_seqs=min(n for n in (sched.max_num_seqs, info.max_num_seqs) if n > 0),
            max_num_batched_tokens=min(n for n in (sched.max_num_batched_tokens, info.max_num_batched_tokens) if n > 0),
            max_model_len=max_model_len,
            policy=sched.scheduling_policy,
            num_scheduler_steps=sched.num_scheduler_steps,
            max_loras=info.max_loras,
        )
        tiers = build_tiers(info, config, metrics)
        # KV tiers save whole block tables when a request ends: they keep every block (no freeing by window).
        window = info.sliding_window if tiers is None else 0
        kv = KVCacheManager(BlockPool(info.num_blocks, config.cache.enable_prefix_caching), info.block_size, window)
        admission = AdmissionLimits(
            max_model_len=max_model_len,
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            vocab_size=info.vocab_size,
            max_waiting_requests=sched.max_waiting_requests,
            window_fits=kv.window_fits(limits.max_num_batched_tokens),
            pooling=info.HasField("pooler"),
            takes_images=bool(info.multimodal_config),
            lora=info.max_loras > 0,
        )
        spec = sched.speculative
        lookahead = Lookahead(spec.num_speculative_tokens, spec.disable_by_batch_size) if spec else None
        return cls(Scheduler(limits, kv, info.eos_token_ids, tiers, lookahead), admission, metrics)

    def plan(self) -> SchedulerOutput:
        """The next step's plan; an empty one (``is_empty``) need not be sent and is not recorded."""
        started = time.perf_counter()
        out = self.scheduler.schedule()
        if self.metrics is not None and not out.is_empty:
            self.metrics.record_plan(out, time.perf_counter() - started, self.scheduler.kv.block_size)
        return out

    def finish_step(
        self,
        out: SchedulerOutput,
        sampled: Iterable[tuple[str, int, Any]],
        execute_seconds: float,
        num_kv_load_failed_tokens: int = 0,
        prompt_logprobs: Iterable[PromptLogprobsChunk] = (),
        pooled: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """The worker ran ``out`` in ``execute_seconds`` and sampled ``(request_id, token_id, logprob)`` rows
        (and pooled vectors by request id, for pooling requests), computing ``num_kv_load_failed_tokens`` of its KV
        tier loads instead, and scored ``prompt_logprobs``; returns the tokens with finish states. Plans must be
        finished in the order they were planned."""
        scheduler = self.scheduler
        self.num_steps += out.num_steps
        scheduler.plan_steps.record(out, execute_seconds)
        if num_kv_load_failed_tokens and scheduler.tiers is not None:
            scheduler.tiers.record_failed_loads(num_kv_load_failed_tokens, out.kv_loads())
        outputs = scheduler.update_from_output(out, sampled, prompt_logprobs, pooled)
        if self.metrics is not None:
            self.metrics.record_state(scheduler)
        return outputs

    def counters(self) -> StepCounters:
        scheduler = self.scheduler
        return StepCounters(
            self.num_steps, scheduler.num_preemptions, scheduler.kv.prefix_queries, scheduler.kv.prefix_hits
        )
