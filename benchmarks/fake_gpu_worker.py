"""A stand-in for a GPU worker: answers each step a fixed time after it could start, with deterministic tokens.

``python -m benchmarks.fake_gpu_worker --port P --step-ms 10`` serves kvgrid.v1.Worker.
Steps run one after another as on a device: a step starts when its plan has
arrived and the previous step has ended, and ends ``step_ms`` later (a plan of several decode steps,
StepPlan.num_steps, that many times ``step_ms``). Each
request keeps only two counters; the token sampled for position p of a request
is a fixed function of (request id, p), and the worker keeps it, as the real
worker does (under async scheduling the next plan computes it).
"""

from __future__ import annotations

import argparse
import asyncio
import time
import zlib

from kvgrid.v1 import worker_pb2, worker_pb2_grpc
from services.common.server import Health, bind, new_server

# Ordinary word pieces of the SmolLM2 vocabulary (ids 300-9000): detokenizing them costs what real text does.
FIRST_TOKEN, NUM_TOKENS = 300, 8700


class FakeGpuWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, step_s: float, num_blocks: int, block_size: int, max_num_seqs: int, model: str):
        self.step_s = step_s
        self.handshake = worker_pb2.HandshakeResponse(
            model=model,
            architecture="LlamaForCausalLM",
            dtype="bfloat16",
            device="cuda:0",
            block_size=block_size,
            num_blocks=num_blocks,
            bytes_per_block=1,
            max_model_len=8192,
            vocab_size=49152,
            eos_token_ids=[2],
            memory=worker_pb2.MemoryProfile(method="fake"),
            max_num_batched_tokens=max(2048, max_num_seqs * 2),
            max_num_seqs=max_num_seqs,
            worker_id="fake-gpu",
        )

    async def Handshake(self, request, context) -> worker_pb2.HandshakeResponse:
        return self.handshake

    async def Execute(self, request_iterator, context):
        arrived: asyncio.Queue = asyncio.Queue()

        async def read() -> None:  # timestamps each plan as it arrives, as a device queue would take it
            async for plan in request_iterator:
                arrived.put_nowait((time.monotonic(), plan))
            arrived.put_nowait((0.0, None))

        reader = asyncio.create_task(read())
        # request id -> [known tokens, computed tokens, id hash]
        seqs: dict[str, list[int]] = {}
        free_at = 0.0
        try:
            while True:
                arrival, plan = await arrived.get()
                if plan is None:
                    return
                result = self._step(plan, seqs)
                # The "device" starts this step when it has the plan and the previous step is done.
                free_at = max(free_at, arrival) + self.step_s * max(plan.num_steps, 1)
                delay = free_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                yield result
        finally:
            reader.cancel()

    def _step(self, plan: worker_pb2.StepPlan, seqs: dict[str, list[int]]) -> worker_pb2.StepResult:
        for request_id in plan.finished_ids:
            seqs.pop(request_id, None)
        scheduled = []
        for new in plan.new_requests:
            seq = [len(new.token_ids), new.num_computed_tokens, zlib.crc32(new.request_id.encode())]
            seqs[new.request_id] = seq
            scheduled.append((new.request_id, seq, new.num_scheduled_tokens))
        for running in plan.running:
            scheduled.append((running.request_id, seqs[running.request_id], running.num_scheduled_tokens))
        num_steps = max(plan.num_steps, 1)
        result = worker_pb2.StepResult(step_id=plan.step_id, execute_seconds=self.step_s * num_steps)
        sampled = result.sampled
        for step in range(num_steps):  # a further step computes the token the one before sampled
            for request_id, seq, num_scheduled in scheduled:
                seq[1] += num_scheduled if step == 0 else 1
                if seq[1] == seq[0]:  # every known token computed: sample the next, and keep it
                    item = sampled.add()
                    item.request_id = request_id
                    item.token_id = FIRST_TOKEN + (seq[2] + seq[0] * 7919) % NUM_TOKENS
                    seq[0] += 1
        return result


async def serve(port: int, step_s: float, num_blocks: int, block_size: int, max_num_seqs: int, model: str) -> None:
    server = new_server()
    worker_pb2_grpc.add_WorkerServicer_to_server(
        FakeGpuWorker(step_s, num_blocks, block_size, max_num_seqs, model), server
    )
    health = Health(server, ["kvgrid.v1.Worker"])
    bind(server, "127.0.0.1", port)
    await server.start()
    health.set(True)
    print(f"fake GPU worker on 127.0.0.1:{port}, {step_s * 1000:.1f} ms per step", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--num-blocks", type=int, default=20000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    a = parser.parse_args()
    asyncio.run(serve(a.port, a.step_ms / 1000, a.num_blocks, a.block_size, a.max_num_seqs, a.model))


if __name__ == "__main__":
    main()
