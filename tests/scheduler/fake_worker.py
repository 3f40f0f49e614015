"""A fake kvgrid.v1.Worker for tests: a real gRPC server, deterministic tokens, strict protocol checks.

It follows the Execute protocol faithfully: keeps per-request state from the
diffs, drops finished ids before running a step, samples once a request's
computed tokens reach the end of its known tokens and keeps that token itself.
It models the KV cache as ``kv[block][slot] = token id at that position`` and
checks that every prefix-cache hit reads back the right tokens, that block
tables cover what is computed, and that no block written in a step belongs to
another live request. A violation is recorded in ``errors`` and breaks the
stream with FAILED_PRECONDITION.

Reusable from other suites::

    worker = await start_fake_worker(num_blocks=64, block_size=16)
    ... config.network.worker_addr = worker.addr ...
    await worker.stop()
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from kvgrid.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.server import bind, new_server


def next_token(token_ids: list[int], vocab_size: int) -> int:
    """The fake model: the next token is a function of the whole sequence so far."""
    return (sum(token_ids) * 31 + len(token_ids)) % vocab_size


def generate(prompt: list[int], num_tokens: int, vocab_size: int, stop_ids=()) -> list[int]:
    """What a request gets without any scheduling effects (stops after a token in ``stop_ids``)."""
    tokens = list(prompt)
    out = []
    for _ in range(num_tokens):
        token = next_token(tokens, vocab_size)
        tokens.append(token)
        out.append(token)
        if token in stop_ids:
            break
    return out


@dataclass(slots=True)
class FakeWorkerConfig:
    num_blocks: int = 64
    block_size: int = 16
    max_model_len: int = 1024
    # Every layer slides over this many positions (0: none): the blocks before a request's window are not its
    # own any more (the scheduler may have freed them), and each token reads back every key in its window.
    sliding_window: int = 0
    vocab_size: int = 1000
    eos_token_ids: tuple[int, ...] = ()
    model: str = "SmolLM2-135M-Instruct"
    tokenizer_files: dict[str, bytes] = field(default_factory=dict)
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    worker_id: str = "fake-worker"
    # Seconds each step takes (lets tests act while a step is in flight).
    step_delay: float = 0.0


@dataclass(slots=True)
class _Seq:
    token_ids: list[int]
    block_ids: list[int]
    num_computed: int
    want_logprobs: bool


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, config: FakeWorkerConfig):
        self.config = config
        self.errors: list[str] = []
        self.num_steps = 0  # decode steps: a plan of several counts as that many
        self.num_multi_step_plans = 0
        self.num_handshakes = 0
        # Set by a test to hold steps (the worker reads the plan, then waits before answering).
        self.gate = asyncio.Event()
        self.gate.set()
        # State of the current Execute stream, exposed for assertions.
        self.seqs: dict[str, _Seq] = {}
        self.trace_contexts: dict[str, dict[str, str]] = {}

    async def Handshake(self, request, context) -> worker_pb2.HandshakeResponse:
        self.num_handshakes += 1
        c = self.config
        return worker_pb2.HandshakeResponse(
            model=c.model,
            architecture="LlamaForCausalLM",
            dtype="float32",
            device="cpu",
            block_size=c.block_size,
            num_blocks=c.num_blocks,
            bytes_per_block=1,
            max_model_len=c.max_model_len,
            vocab_size=c.vocab_size,
            eos_token_ids=c.eos_token_ids,
            memory=worker_pb2.MemoryProfile(method="cpu-configured"),
            tokenizer_files=c.tokenizer_files,
            max_num_batched_tokens=c.max_num_batched_tokens,
            max_num_seqs=c.max_num_seqs,
            sliding_window=c.sliding_window,
            worker_id=c.worker_id,
        )

    async def Execute(self, request_iterator, context):
        model = FakeModel(self.config)
        self.seqs = model.seqs
        self.trace_contexts = model.trace_contexts
        async for plan in request_iterator:
            await self.gate.wait()
            if self.config.step_delay:
                await asyncio.sleep(self.config.step_delay)
            try:
                result = model.step(plan)
            except AssertionError as e:
                self.errors.append(f"step {plan.step_id}: {e}")
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"fake worker: {e}")
            self.num_steps += max(plan.num_steps, 1)
            self.num_multi_step_plans += plan.num_steps > 1
            yield result


class FakeModel:
    """The worker side of one Execute stream, synchronous: also usable directly in unit tests."""

    def __init__(self, config: FakeWorkerConfig):
        self.config = config
        self.seqs: dict[str, _Seq] = {}
        # kv[block_id][slot] = the token id whose K/V the slot holds.
        self.kv: dict[int, dict[int, int]] = {}
        # The trace_context each request arrived with (last NewRequest).
        self.trace_contexts: dict[str, dict[str, str]] = {}
        # KV tiers: ("host", slot) or ("redis", key) -> a saved block's kv entry. Share the dict to share a tier.
        self.tier_store: dict[tuple, dict[int, int]] = {}

    def step(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepResult:
        """Run one plan (``num_steps`` decode steps of it); raises AssertionError on any protocol violation."""
        seqs, kv = self.seqs, self.kv
        bs = self.config.block_size
        for request_id in plan.finished_ids:
            assert request_id in seqs, f"finished id {request_id!r} is not held"
            del seqs[request_id]
        # Saves copy blocks before anything in the step writes them; loads fill a new request's blocks.
        for save in plan.kv_saves:
            self.tier_store[_tier_key(save)] = dict(kv.get(save.block_id, {}))
        for new in plan.new_requests:
            for load in new.kv_loads:
                assert _tier_key(load) in self.tier_store, f"{new.request_id}: loads {_tier_key(load)}, never saved"
                kv[load.block_id] = dict(self.tier_store[_tier_key(load)])
        scheduled: list[tuple[str, int, int]] = []  # (request id, tokens, lookahead tokens)
        for new in plan.new_requests:
            assert new.request_id not in seqs, f"new request {new.request_id!r} is held already"
            assert new.num_computed_tokens + new.num_scheduled_tokens <= len(new.token_ids), "schedules past the end"
            assert new.num_computed_tokens % bs == 0, "a prefix hit must cover whole blocks"
            seq = _Seq(list(new.token_ids), list(new.block_ids), new.num_computed_tokens, new.sampling.logprobs > 0)
            # The prefix hit must read back exactly these tokens (those the first new token's window reads).
            window = self.config.sliding_window
            for pos in range(max(new.num_computed_tokens - window + 1, 0) if window else 0, new.num_computed_tokens):
                got = kv.get(seq.block_ids[pos // bs], {}).get(pos % bs)
                assert got == seq.token_ids[pos], f"{new.request_id}: stale prefix block at position {pos}"
            seqs[new.request_id] = seq
            self.trace_contexts[new.request_id] = dict(new.trace_context)
            scheduled.append((new.request_id, new.num_scheduled_tokens, 0))
        for running in plan.running:
            assert running.request_id in seqs, f"running request {running.request_id!r} is not held"
            seqs[running.request_id].block_ids.extend(running.new_block_ids)
            scheduled.append((running.request_id, running.num_scheduled_tokens, running.num_lookahead_tokens))

        window = self.config.sliding_window

        def live(seq: _Seq) -> list[int]:
            """The blocks the request may still read: from its next token's window on."""
            return seq.block_ids[max(seq.num_computed - window + 1, 0) // bs :] if window else seq.block_ids

        holders: dict[int, list[str]] = {}
        for request_id, seq in seqs.items():
            for block_id in live(seq):
                assert 0 <= block_id < self.config.num_blocks, f"block id {block_id} out of range"
                holders.setdefault(block_id, []).append(request_id)
        num_steps = max(plan.num_steps, 1)
        assert num_steps == 1 or not plan.new_requests, f"a plan of {num_steps} steps with new requests"
        sampled = []
        for step in range(num_steps):
            for request_id, num_scheduled, lookahead in scheduled:
                seq = seqs[request_id]
                if step:
                    num_scheduled = 1  # each further step computes the token the step before sampled
                assert num_scheduled > 0, f"{request_id}: zero tokens scheduled"
                end = seq.num_computed + num_scheduled
                assert end <= len(seq.token_ids), f"{request_id}: schedules {end} tokens, knows {len(seq.token_ids)}"
                assert num_steps == 1 or (num_scheduled == 1 and end == len(seq.token_ids)), (
                    f"{request_id}: a plan of {num_steps} steps that does not decode it"
                )
                assert len(seq.block_ids) * bs >= end, f"{request_id}: {len(seq.block_ids)} blocks for {end} tokens"
                assert len(set(live(seq))) == len(live(seq)), f"{request_id}: a block twice in its table"
                for pos in range(seq.num_computed, end):
                    block_id = seq.block_ids[pos // bs]
                    owners = holders[block_id]
                    assert owners == [request_id], f"{request_id} writes block {block_id}, held by {owners}"
                    kv.setdefault(block_id, {})[pos % bs] = seq.token_ids[pos]
                    for key in range(max(pos - window + 1, 0), pos) if window else ():
                        got = kv.get(seq.block_ids[key // bs], {}).get(key % bs)
                        assert got == seq.token_ids[key], f"{request_id}: position {pos} reads a stale key at {key}"
                seq.num_computed = end
                if lookahead:
                    self._speculate(request_id, seq, lookahead, sampled)
                elif end == len(seq.token_ids):
                    token = next_token(seq.token_ids, self.config.vocab_size)
                    seq.token_ids.append(token)
                    item = worker_pb2.SampledToken(request_id=request_id, token_id=token)
                    if seq.want_logprobs:
                        item.logprob.CopyFrom(common_pb2.TokenLogprob(token_id=token, logprob=-1.0))
                    sampled.append(item)
        return worker_pb2.StepResult(step_id=plan.step_id, sampled=sampled, execute_seconds=0.0)

    def _speculate(self, request_id: str, seq: _Seq, lookahead: int, sampled: list) -> None:
        """A decode with ``lookahead`` proposals: the first ``accepted`` (a function of the sequence) are the
        model's own tokens, the rest wrong (their slots hold -1, so a prefix hit that reads one fails); answers
        the accepted ones and one more."""
        bs, vocab = self.config.block_size, self.config.vocab_size
        assert seq.num_computed == len(seq.token_ids), f"{request_id}: lookahead on a row that does not decode"
        assert len(seq.block_ids) * bs >= seq.num_computed + lookahead, f"{request_id}: no slots for the lookahead"
        accepted = (sum(seq.token_ids) + len(seq.token_ids)) % (lookahead + 1)
        for i in range(lookahead):
            pos = seq.num_computed + i
            self.kv.setdefault(seq.block_ids[pos // bs], {})[pos % bs] = -1
        for i in range(accepted + 1):
            token = next_token(seq.token_ids, vocab)
            seq.token_ids.append(token)
            if i < accepted:  # its K/V were written by this pass
                self.kv[seq.block_ids[seq.num_computed // bs]][seq.num_computed % bs] = token
                seq.num_computed += 1
            sampled.append(worker_pb2.SampledToken(request_id=request_id, token_id=token))


def _tier_key(block: worker_pb2.KvTierBlock) -> tuple:
    tier = block.WhichOneof("tier")
    return (tier, getattr(block, tier))


@dataclass(slots=True)
class FakeWorkerServer:
    server: grpc.aio.Server
    port: int
    worker: FakeWorker

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self, grace: float | None = None) -> None:
        """Stop at once (grace None): open Execute streams break mid-step."""
        await self.server.stop(grace)


async def start_fake_worker(port: int = 0, **config) -> FakeWorkerServer:
    worker = FakeWorker(FakeWorkerConfig(**config))
    server = new_server()
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
    bound = bind(server, "127.0.0.1", port)
    await server.start()
    return FakeWorkerServer(server, bound, worker)
