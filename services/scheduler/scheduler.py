"""The token-budget scheduler: pure Python, a plan out per step and results back.

Each step: running requests first (in admission order), each given the tokens it
still lacks up to the remaining budget (a prompt longer than the budget is
prefilled in chunks over several steps); when the pool runs dry, the request
that would be preempted last is kept and others are preempted by recompute
(fcfs: the most recently admitted; priority: the lowest priority, latest
arrival). Then, if nothing was preempted, waiting requests are admitted in queue
order while budget, sequence cap and blocks allow (head-of-line: admission
stops at the first request that does not fit).

Async scheduling: ``schedule`` may be called again before the previous plan's
result is back. A request planned to sample holds an output placeholder until
its token arrives; the next plan counts the placeholder as a known token (the
worker computes the token it sampled itself), and skips a request whose pending
token will end it by length. A stop found when the token arrives is one step
late: the token sampled for that request in the step already planned is
discarded in ``update_from_output``, never returned.

Plans of several steps (``SchedulerOutput.num_steps``): while every running
request decodes and none waits, a plan may stand for several decode steps; see
``plan_steps``. A request that stops within one drops the tokens after its
stop; the worker ends a plan early once every request in it has sampled a stop
token.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from services.scheduler.encoder_budget import EncoderBudget
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.kv_tiers import KvTiers, TierBlock
from services.scheduler.lookahead import Lookahead
from services.scheduler.micro_batches import MicroBatches
from services.scheduler.plan_steps import PlanSteps
from services.scheduler.prompt_logprobs import PromptLogprobsChunk, PromptLogprobsError, needs_prompt_logprobs
from services.scheduler.prompt_logprobs import accept as accept_prompt_logprobs
from services.scheduler.prompt_logprobs import take as take_prompt_logprobs
from services.scheduler.queues import make_waiting_queue
from services.scheduler.request import Request, RequestStatus
from services.scheduler.step_plan import NewRequestPlan, RequestOutput, RunningRequestPlan, SchedulerOutput


class WorkerProtocolError(RuntimeError):
    """The worker's result contradicts the plan (a missing or unexpected sampled token)."""


@dataclass(slots=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    # Longest sequence, prompt + output; a request reaching it finishes with "length".
    max_model_len: int
    policy: str = "fcfs"
    # Decode steps a plan may stand for: a fixed count, or 0 for auto (see ``plan_steps``).
    num_scheduler_steps: int = 1
    # Distinct LoRA adapters among the running requests (the worker's device slots); 0: LoRA off.
    max_loras: int = 0


class Scheduler:
    def __init__(
        self,
        limits: SchedulerLimits,
        kv: KVCacheManager,
        eos_token_ids: Iterable[int] = (),
        tiers: KvTiers | None = None,
        lookahead: Lookahead | None = None,
    ):
        self.limits = limits
        self.lookahead = lookahead
        self.kv = kv
        self.tiers = tiers
        if tiers is not None:
            kv.pool.on_evict = tiers.on_evict
        self.eos_token_ids = frozenset(eos_token_ids)
        # A request reaching this many tokens finishes with "length". Capped at what the whole pool holds: a longer
        # sequence could never be computed again after a preemption; unless the blocks behind a sliding window
        # are freed and the pool holds a window and a step's tokens, which any length needs at most.
        self.max_seq_len = limits.max_model_len
        if not kv.window_fits(limits.max_num_batched_tokens):
            self.max_seq_len = min(limits.max_model_len, kv.pool.num_blocks * kv.block_size)
        self.waiting = make_waiting_queue(limits.policy)
        # Admission order; fcfs preempts from the end.
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._drop_on_worker: list[str] = []
        self._next_arrival = 0
        self.step_id = 0
        self.num_preemptions = 0
        # Sizes plans of several decode steps; callers report each plan's time to it (``PlanSteps.record``).
        self.plan_steps = PlanSteps(limits.num_scheduler_steps)
        # A pipeline's plans in flight over disjoint requests (``micro_batches``); None: plans may share requests.
        self.micro_batches: MicroBatches | None = None

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(
            self.running or len(self.waiting) or self._drop_on_worker or (self.tiers and self.tiers.has_saves())
        )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already live")
        request.arrival_seq = self._next_arrival
        self._next_arrival += 1
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Abort in any state; its blocks are freed at once. Returns the request, None if not live."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._release(request, RequestStatus.FINISHED_ABORTED)
        return request

    def schedule(self) -> SchedulerOutput:
        self.step_id += 1
        out = SchedulerOutput(step_id=self.step_id)
        if self.tiers is not None:
            self.tiers.begin_plan()
        budget = self.limits.max_num_batched_tokens
        # request_id -> plan, in scheduling order; a priority preemption may take one back out.
        planned: dict[str, RunningRequestPlan] = {}
        steps = self.plan_steps.count(self.running, len(self.waiting), budget, self.max_seq_len)
        encoder = EncoderBudget(budget)
        lookahead = self.lookahead
        if lookahead is not None:
            steps = 1  # the next plan needs this one's token count
            if not lookahead.enabled(len(self.running)):
                lookahead = None
        if self.micro_batches is not None and len(self.running) > 1:
            steps = 1  # a plan of several steps runs alone: the pipeline drains for it

        share = self.micro_batches.share(len(self.running)) if self.micro_batches is not None else len(self.running)
        i = 0
        while i < len(self.running) and budget > 0 and len(planned) < share:
            request = self.running[i]
            num_new = len(request.all_token_ids) + request.num_output_placeholders - request.num_computed_tokens
            if num_new <= 0 or self._ends_when_sampled(request) or self._held(request):
                i += 1  # its pending token ends it (by length), it waits for that token, or another micro-batch has it
                continue
            if num_new > budget:
                num_new = budget
            if request.mm_spans:
                num_new = encoder.fit(request.mm_spans, request.num_computed_tokens, num_new, first=False)
                if not num_new:
                    i += 1  # its next image waits for a step with encoder budget left
                    continue
            if steps > 1 and not self.kv.allocate_slots(request, steps):
                steps = 1  # the pool cannot hold the plan's tokens: one step, preempting as a step does
            k = lookahead.count(request, self.max_seq_len) if lookahead is not None and num_new == 1 else 0
            k = min(k, budget - num_new)
            if k and not self.kv.allocate_slots(request, num_new + k):
                k = 0  # no room for proposals: a plain decode, preempting as one does
            while not self.kv.allocate_slots(request, num_new):
                victim = self._pick_victim()
                victim_index = self.running.index(victim)
                self.running.pop(victim_index)
                self._preempt(victim, out)
                taken_back = planned.pop(victim.request_id, None)
                if taken_back is not None:
                    budget += taken_back.num_scheduled_tokens + taken_back.num_lookahead_tokens
                if victim_index < i:
                    i -= 1
                if victim is request:
                    break
            else:
                planned[request.request_id] = RunningRequestPlan(request, [], num_new, num_lookahead_tokens=k)
                budget -= num_new + k
                i += 1

        for plan in planned.values():
            request = plan.request
            table = self.kv.blocks_of(request.request_id)
            if len(table) > request.num_blocks_sent:
                plan.new_block_ids = [block.block_id for block in table[request.num_blocks_sent :]]
                request.num_blocks_sent = len(table)
            request.num_computed_tokens += plan.num_scheduled_tokens
            if request.num_computed_tokens == len(request.all_token_ids) + request.num_output_placeholders:
                plan.samples = True
                request.num_output_placeholders += 1
            out.total_num_scheduled_tokens += plan.num_scheduled_tokens
        out.running = list(planned.values())
        if steps > 1 and out.running:
            for plan in out.running:  # each further step computes the token the one before sampled, and samples
                plan.request.num_computed_tokens += steps - 1
                plan.request.num_output_placeholders += steps - 1
            out.num_steps = steps

        if not out.preempted_ids:
            self._admit_waiting(out, self.limits.max_num_batched_tokens - out.total_num_scheduled_tokens, encoder)

        out.finished_ids = self._drop_on_worker
        self._drop_on_worker = []
        if self.tiers is not None:
            out.kv_saves = self.tiers.take_saves()
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int, encoder: EncoderBudget) -> None:
        while len(self.waiting) and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            request = self.waiting.peek()
            if self._held(request):
                break  # preempted while a plan in flight still computes it: admitted once that plan is back
            if request.lora_name and not self._adapter_fits(request.lora_name):
                break  # head-of-line, as for blocks: the adapters running now drain, then it runs (never starved)
            readable = not needs_prompt_logprobs(request)  # a prompt being scored is computed whole
            hit_blocks, num_hit = self.kv.get_computed_blocks(request) if readable else ([], 0)
            loads: list[TierBlock] = []
            if self.tiers is not None and readable:
                loads = self.tiers.lookup(request, len(hit_blocks))
                self.tiers.pin(request, len(hit_blocks), loads)
            num_loaded = len(loads) * self.kv.block_size
            num_new = min(request.num_tokens - num_hit - num_loaded, budget)
            if request.mm_spans:
                num_new = encoder.fit(request.mm_spans, num_hit + num_loaded, num_new, first=True)
                if not num_new:
                    break  # its first image waits for a step with encoder budget left
            if not self.kv.allocate_slots(request, num_loaded + num_new, hit_blocks):
                break
            self.waiting.pop()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
                self.kv.record_lookup(request.num_tokens, num_hit)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit + num_loaded + num_new
            request.on_worker = True
            block_ids = self.kv.block_ids(request.request_id)
            if self.tiers is not None:
                self.tiers.commit(request, loads, block_ids, len(hit_blocks))
            request.num_blocks_sent = len(block_ids)
            self.running.append(request)
            samples = request.num_computed_tokens == request.num_tokens
            request.num_output_placeholders = int(samples)
            out.new_requests.append(NewRequestPlan(request, block_ids, num_hit + num_loaded, num_new, samples, loads))
            out.total_num_scheduled_tokens += num_new
            budget -= num_new

    def _held(self, request: Request) -> bool:
        return self.micro_batches is not None and self.micro_batches.waits(request)

    def running_adapters(self) -> set[str]:
        """The LoRA adapters of the running requests (those the worker holds in its slots)."""
        return {r.lora_name for r in self.running if r.lora_name}

    def _adapter_fits(self, lora_name: str) -> bool:
        """Every running request stays in every step's reach, so the running set holds at most max_loras adapters."""
        adapters = self.running_adapters()
        return lora_name in adapters or len(adapters) < self.limits.max_loras

    def _pick_victim(self) -> Request:
        if self.limits.policy == "priority":
            return max(self.running, key=Request.sort_key)
        return self.running[-1]

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.kv.free(request)
        if request.on_worker:
            self._drop_on_worker.append(request.request_id)
        _reset_for_recompute(request)
        self.num_preemptions += 1
        out.preempted_ids.append(request.request_id)
        self.waiting.add_preempted(request)

    def _ends_when_sampled(self, request: Request) -> bool:
        """Whether the token in flight for ``request`` will end it by length (so planning more is waste)."""
        pending = request.num_output_placeholders
        if not pending:
            return False
        num_tokens = len(request.all_token_ids) + pending
        return num_tokens >= self.max_seq_len or num_tokens - request.num_prompt_tokens >= request.stop.max_tokens

    def evacuate(self) -> list[Request]:
        """The worker is gone, and its KV cache with it: every live request leaves this scheduler as if preempted
        (blocks released, prompt and outputs kept). Running requests come first in admission order, then the
        waiting queue in its order: the order in which ``adopt`` resumes them."""
        requests = [*self.running, *self.waiting]
        for request in requests:
            self.kv.free(request)
            _reset_for_recompute(request)
        self.running = []
        self.waiting = make_waiting_queue(self.limits.policy)
        self.requests = {}
        self._drop_on_worker = []
        return requests

    def adopt(self, requests: Iterable[Request]) -> list[Request]:
        """Take requests evacuated from another worker's pool; they resume by recompute ahead of any request
        that arrives later (they keep their arrival order). Returns, without taking them, those whose tokens
        already reach this pool's longest sequence: they can never be computed here again."""
        rejected = []
        for request in requests:
            if request.num_tokens >= self.max_seq_len:
                rejected.append(request)
                continue
            self.requests[request.request_id] = request
            self.waiting.add(request)
            self._next_arrival = max(self._next_arrival, request.arrival_seq + 1)
        return rejected

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: Iterable[tuple[str, int, Any]],
        prompt_logprobs: Iterable[PromptLogprobsChunk] = (),
        pooled: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply a step's sampled tokens ``(request_id, token_id, logprob)`` and pooled vectors (request id ->
        vector); returns them with finish states. The step's prompt logprobs gather on their requests first, and
        leave with each request's first token.

        A token is kept only for the very request object the plan sampled for, still running: a request aborted,
        preempted or finished (one step late, under async scheduling) while the step ran loses its token, and
        so does an older request whose id was reused meanwhile.
        """
        tokens: dict[str, list[tuple[int, Any]]] = {}
        for request_id, token_id, logprob in sampled:
            samples = tokens.get(request_id)
            if samples is None:
                tokens[request_id] = [(token_id, logprob)]
            else:
                samples.append((token_id, logprob))
        if prompt_logprobs:
            plans = (*out.new_requests, *out.running)
            planned = {plan.request.request_id: plan.request for plan in plans}
            try:
                accept_prompt_logprobs(planned, self.requests, prompt_logprobs)
            except PromptLogprobsError as e:
                raise WorkerProtocolError(f"step {out.step_id}: {e}") from None
        num_steps = out.num_steps
        results = []
        num_finished = 0
        requests = self.requests
        running = RequestStatus.RUNNING
        cache = self.kv.cache_computed_blocks
        for plans in (out.new_requests, out.running):
            for plan in plans:
                request = plan.request
                request_id = request.request_id
                if not plan.samples:
                    if request.status is running:
                        cache(request)
                    continue
                if request.pooling is not None:
                    if request.status is running and requests.get(request_id) is request:
                        results.append(self._finish_pooled(request, (pooled or {}).get(request_id), out.step_id))
                        num_finished += 1
                    continue
                samples = tokens.pop(request_id, None)
                if request.status is not running or requests.get(request_id) is not request:
                    continue  # its tokens (if any) are discarded
                got, k = len(samples) if samples else 0, getattr(plan, "num_lookahead_tokens", 0)
                if not 1 <= got <= (1 + k if k else num_steps):
                    raise WorkerProtocolError(
                        f"step {out.step_id}: {got} tokens sampled for {request_id!r}, planned {num_steps}"
                    )
                if not k and got < num_steps:  # the worker ended the plan early: every request in it stopped
                    request.num_computed_tokens -= num_steps - got  # (the steps not run computed nothing)
                for i, (token_id, logprob) in enumerate(samples):
                    if i < num_steps:
                        request.num_output_placeholders -= 1
                    else:  # an accepted proposal: the step computed its K/V
                        request.num_computed_tokens += 1
                    request.all_token_ids.append(token_id)
                    finish = self._check_stop(request, token_id)
                    results.append(RequestOutput(request, token_id, logprob, finish))
                    if request.prompt_logprobs:
                        results[-1].prompt_logprobs = take_prompt_logprobs(request)
                    if finish is not None:
                        break  # the tokens the plan sampled after the stop are discarded
                if finish is None and got < num_steps:
                    raise WorkerProtocolError(
                        f"step {out.step_id}: {got} of {num_steps} tokens for {request_id!r}, which did not stop"
                    )
                cache(request)
                if finish is not None:
                    del requests[request_id]
                    self._release(request, finish)
                    num_finished += 1
        if tokens and any(requests.get(request_id) is not None for request_id in tokens):
            unexpected = ", ".join(sorted(tokens))
            raise WorkerProtocolError(f"step {out.step_id}: tokens sampled for requests planned not to: {unexpected}")

        if num_finished:
            self.running = [request for request in self.running if request.status is running]
        return results

    def _finish_pooled(self, request: Request, vector: Any, step_id: int) -> RequestOutput:
        """A pooling request's prompt is computed: it ends with its vector and its blocks are freed now."""
        if vector is None:
            raise WorkerProtocolError(f"step {step_id}: no pooled vector for {request.request_id!r}")
        request.num_output_placeholders = 0
        self.kv.cache_computed_blocks(request)
        del self.requests[request.request_id]
        self._release(request, RequestStatus.FINISHED_STOPPED)
        return RequestOutput(request, 0, None, RequestStatus.FINISHED_STOPPED, pooled=vector)

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        stop = request.stop
        num_tokens = len(request.all_token_ids)
        num_output = num_tokens - len(request.prompt_token_ids)
        if num_output >= stop.min_tokens and (
            token_id in stop.stop_token_ids or (not stop.ignore_eos and token_id in self.eos_token_ids)
        ):
            return RequestStatus.FINISHED_STOPPED
        if num_output >= stop.max_tokens or num_tokens >= self.max_seq_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _release(self, request: Request, status: RequestStatus) -> None:
        if self.tiers is not None:
            self.tiers.on_release(request, self.kv.blocks_of(request.request_id))
        self.kv.free(request)
        if request.on_worker:
            self._drop_on_worker.append(request.request_id)
        request.on_worker = False
        request.status = status


def _reset_for_recompute(request: Request) -> None:
    """Back to a waiting request that holds no blocks; its tokens are computed again when it is next admitted."""
    request.on_worker = False
    request.num_blocks_sent = 0
    request.num_computed_tokens = 0
    request.num_output_placeholders = 0  # a token still in flight for it is discarded when it arrives
    request.num_preemptions += 1
    request.status = RequestStatus.PREEMPTED
