"""A minimal scheduler for tests: drives a worker over its real gRPC Execute stream."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgrid.v1 import common_pb2, worker_pb2


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    sampling: common_pb2.SamplingParams
    outputs: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    started: bool = False

    @property
    def known(self) -> int:
        return len(self.prompt) + len(self.outputs)

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.max_tokens


class Driver:
    """Schedules every request every step: prefill in chunks of ``chunk`` tokens, then one token per step."""

    def __init__(self, call, block_size: int, num_blocks: int):
        self.call = call
        self.block_size = block_size
        self.free = list(range(num_blocks))[::-1]  # hand out high ids first: tables are not 0..n
        self.step_id = 0

    async def step(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepResult:
        self.step_id += 1
        plan.step_id = self.step_id
        await self.call.write(plan)
        result = await self.call.read()
        assert result.step_id == self.step_id
        return result

    async def generate(
        self, prompts: list[list[int]], max_tokens: int, chunk: int = 10**9, sampling=None
    ) -> list[_Req]:
        sampling = sampling or common_pb2.SamplingParams()
        reqs = [_Req(f"req-{self.step_id}-{i}", p, max_tokens, sampling) for i, p in enumerate(prompts)]
        finished: list[str] = []
        while any(not r.done for r in reqs):
            plan = worker_pb2.StepPlan(finished_ids=finished)
            finished = []
            for r in reqs:
                if r.done:
                    continue
                n = min(chunk, r.known - r.computed)
                need = -(-(r.computed + n) // self.block_size) - len(r.blocks)
                new_blocks = [self.free.pop() for _ in range(need)]
                r.blocks += new_blocks
                if not r.started:
                    plan.new_requests.append(
                        worker_pb2.NewRequest(
                            request_id=r.rid,
                            token_ids=r.prompt,
                            num_prompt_tokens=len(r.prompt),
                            sampling=r.sampling,
                            block_ids=r.blocks,
                            num_computed_tokens=0,
                            num_scheduled_tokens=n,
                        )
                    )
                    r.started = True
                else:
                    plan.running.append(
                        worker_pb2.RunningRequest(request_id=r.rid, new_block_ids=new_blocks, num_scheduled_tokens=n)
                    )
                r.computed += n
            result = await self.step(plan)
            by_id = {s.request_id: s for s in result.sampled}
            for r in reqs:
                if r.rid in by_id:
                    assert r.computed == r.known, "sampled before the prompt was complete"
                    r.outputs.append(by_id[r.rid].token_id)
                    if by_id[r.rid].HasField("logprob"):
                        r.logprobs.append(by_id[r.rid].logprob)
                    if r.done:
                        finished.append(r.rid)
                        self.free += r.blocks
                else:
                    assert r.done or r.computed < r.known, f"{r.rid} reached its end but sampled nothing"
        if finished:
            await self.step(worker_pb2.StepPlan(finished_ids=finished))
        return reqs
