"""Conversions between the scheduler's plain types and the kvgrid.v1 messages."""

from __future__ import annotations

from kvgrid.v1 import common_pb2, scheduler_pb2, worker_pb2
from services.scheduler.kv_tiers import TierBlock
from services.scheduler.request import DEFAULT_MAX_TOKENS, RequestStatus, StopConditions
from services.scheduler.step_plan import RequestOutput, SchedulerOutput

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: common_pb2.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: common_pb2.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: common_pb2.FINISH_REASON_ABORT,
}


def stop_conditions_from_proto(sampling: common_pb2.SamplingParams) -> StopConditions:
    return StopConditions(
        max_tokens=sampling.max_tokens or DEFAULT_MAX_TOKENS,
        min_tokens=sampling.min_tokens,
        stop_token_ids=frozenset(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        structured=sampling.WhichOneof("structured_output") is not None,
    )


def plan_to_proto(out: SchedulerOutput) -> worker_pb2.StepPlan:
    plan = worker_pb2.StepPlan(step_id=out.step_id, finished_ids=out.finished_ids)
    if out.num_steps > 1:
        plan.num_steps = out.num_steps
    for new in out.new_requests:
        request = new.request
        plan.new_requests.append(
            worker_pb2.NewRequest(
                request_id=request.request_id,
                token_ids=request.all_token_ids,
                num_prompt_tokens=request.num_prompt_tokens,
                sampling=request.sampling,
                block_ids=new.block_ids,
                num_computed_tokens=new.num_computed_tokens,
                num_scheduled_tokens=new.num_scheduled_tokens,
                trace_context=request.trace_context,
                kv_loads=[tier_block_to_proto(load) for load in new.kv_loads],
                num_prompt_logprobs_done=request.num_prompt_logprobs,
                pooling=request.pooling,
                mm_inputs=request.mm_inputs,
                lora=request.lora,
            )
        )
    running = plan.running
    for item in out.running:
        # add() then field writes avoids building and copying a message per request (decode hot path).
        entry = running.add()
        entry.request_id = item.request.request_id
        entry.num_scheduled_tokens = item.num_scheduled_tokens
        if item.new_block_ids:
            entry.new_block_ids.extend(item.new_block_ids)
        if item.num_lookahead_tokens:
            entry.num_lookahead_tokens = item.num_lookahead_tokens
    if out.kv_saves:
        plan.kv_saves.extend(tier_block_to_proto(save) for save in out.kv_saves)
    return plan


def tier_block_to_proto(block: TierBlock) -> worker_pb2.KvTierBlock:
    if block.host_slot >= 0:
        return worker_pb2.KvTierBlock(block_id=block.block_id, host_slot=block.host_slot)
    return worker_pb2.KvTierBlock(block_id=block.block_id, redis_key=block.redis_key)


def sampled_from_proto(result: worker_pb2.StepResult, want_logprobs: bool = True) -> list[tuple]:
    """(request_id, token_id, logprob or None) per sampled token."""
    return [
        (s.request_id, s.token_id, s.logprob if want_logprobs and s.HasField("logprob") else None)
        for s in result.sampled
    ]


def prompt_logprobs_from_proto(result: worker_pb2.StepResult) -> list[tuple]:
    """(request_id, start, entries) per request the step scored prompt tokens of."""
    return [(chunk.request_id, chunk.start, list(chunk.logprobs)) for chunk in result.prompt_logprobs]


def pooled_from_proto(result: worker_pb2.StepResult) -> dict[str, list[float]]:
    """Pooling requests' vectors by request id."""
    return {p.request_id: p.data for p in result.pooled}


def add_output(response: scheduler_pb2.SubmitResponse, output: RequestOutput) -> None:
    """Append one sampled token (and its logprob and finish reason, if any), or a pooling request's vector, to a
    request's delta."""
    if output.pooled is not None:
        response.embedding.extend(output.pooled)
    else:
        response.token_ids.append(output.token_id)
    if output.logprob is not None:
        response.logprobs.append(output.logprob)
    if output.prompt_logprobs is not None:
        response.prompt_logprobs.extend(output.prompt_logprobs)
    if output.finish is not None:
        response.finish_reason = FINISH_REASONS[output.finish]
