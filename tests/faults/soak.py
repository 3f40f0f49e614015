"""The fault-injection soak: many requests of mixed kinds while services are killed at random moments.

Every request must end with its full output (a greedy one equal to its reference), or with a clear status:
INVALID_ARGUMENT for bad fields, CANCELLED when the client cancelled, UNAVAILABLE (with a reason) when its
frontend died under it or a worker was lost the moment it arrived. Nothing may hang or leak KV blocks.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.faults.streams import Streams, greedy, prompt

MAX_TOKENS = 24
NUM_PROMPTS = 12
REQUEST_TIMEOUT_S = 600
BAD_FIELDS = [
    {"sampling": common_pb2.SamplingParams(temperature=-1.0)},
    {"sampling": common_pb2.SamplingParams(top_p=1.5)},
    {"sampling": common_pb2.SamplingParams(top_k=-7)},
    {"sampling": common_pb2.SamplingParams(stop_token_ids=[10**9])},
    {"prompt": "", "prompt_token_ids": [1, 10**9]},
    {"prompt": ""},
    {"request_id": "x" * 10_000},
]


@dataclass(slots=True)
class Planned:
    kind: str  # "greedy", "cancel" or "bad"
    request: generate_pb2.GenerateRequest
    prompt_index: int = 0


def plan(num_requests: int, rng: random.Random) -> list[Planned]:
    """10% cancelled by the client, 5% with a bad field, the rest greedy of mixed prompt and output lengths."""
    planned = []
    for i in range(num_requests):
        roll = rng.random()
        p = rng.randrange(NUM_PROMPTS)
        request = greedy(p, rng.randint(1, MAX_TOKENS))
        request.request_id = f"soak-{i}"
        if roll < 0.05:
            bad = generate_pb2.GenerateRequest(prompt=prompt(p), request_id=f"soak-{i}")
            for name, value in rng.choice(BAD_FIELDS).items():
                if name == "sampling":
                    bad.sampling.CopyFrom(value)
                elif name == "prompt_token_ids":
                    bad.prompt_token_ids.extend(value)
                else:
                    setattr(bad, name, value)
            planned.append(Planned("bad", bad))
        elif roll < 0.15:
            request.sampling.max_tokens = MAX_TOKENS  # long enough to be cancelled mid-way
            planned.append(Planned("cancel", request, p))
        else:
            planned.append(Planned("greedy", request, p))
    return planned


def references(addr: str) -> list[list[int]]:
    """Each prompt's greedy output of MAX_TOKENS tokens on a quiet stack."""
    outcomes = Streams(addr, [greedy(p, MAX_TOKENS) for p in range(NUM_PROMPTS)]).wait()
    assert all(o.ok for o in outcomes), [(o.code, o.details) for o in outcomes]
    return [o.token_ids for o in outcomes]


def run_one(stub, item: Planned) -> tuple[str, list[int], str]:
    """(outcome, token ids, details): outcome is the finish reason or the status code's name."""
    tokens: list[int] = []
    finish = ""
    try:
        call = stub.Generate(item.request, timeout=REQUEST_TIMEOUT_S)
        for response in call:
            tokens.extend(response.token_ids)
            finish = finish or response.finish_reason
            if item.kind == "cancel" and tokens and not finish:
                call.cancel()
    except grpc.RpcError as e:
        return e.code().name, tokens, e.details() or ""
    return finish, tokens, ""


class Soak:
    """Run ``planned`` with ``concurrency`` clients; ``chaos[k]`` runs once ``k`` requests have ended (each
    returns once the stack serves again; new requests wait for that)."""

    def __init__(self, addr: str, refs: list[list[int]], concurrency: int = 12):
        self.addr = addr
        self.refs = refs
        self.concurrency = concurrency
        self.counts: Counter[str] = Counter()
        self.problems: list[str] = []
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self._ended = 0

    def run(self, planned: list[Planned], chaos: dict[int, Callable[[], None]]) -> Counter[str]:
        with grpc.insecure_channel(self.addr) as channel:
            stub = generate_pb2_grpc.TextGenerationStub(channel)
            with ThreadPoolExecutor(self.concurrency) as pool:
                futures = [pool.submit(self._one, stub, item) for item in planned]
                done_chaos = set()
                while not all(f.done() for f in futures):
                    for k in sorted(chaos):
                        if k not in done_chaos and self._ended >= k:
                            done_chaos.add(k)
                            self._open.clear()
                            chaos[k]()
                            self._open.set()
                    time.sleep(0.05)
                for f in futures:
                    f.result()
        return self.counts

    def _one(self, stub, item: Planned) -> None:
        self._open.wait()
        outcome, tokens, details = run_one(stub, item)
        with self._lock:
            self._ended += 1
            self.counts[f"{item.kind}:{outcome}"] += 1
            self._check(item, outcome, tokens, details)

    def _check(self, item: Planned, outcome: str, tokens: list[int], details: str) -> None:
        rid = item.request.request_id
        if outcome == "length":  # a full output: exactly the reference's first max_tokens tokens
            want = self.refs[item.prompt_index][: item.request.sampling.max_tokens]
            if item.kind == "bad" or tokens != want:
                self.problems.append(f"{rid} ({item.kind}): output {tokens} != reference {want}")
        elif outcome == "UNAVAILABLE":
            if not details:
                self.problems.append(f"{rid}: UNAVAILABLE without a reason")
        elif (item.kind, outcome) not in (("bad", "INVALID_ARGUMENT"), ("cancel", "CANCELLED")):
            self.problems.append(f"{rid} ({item.kind}): ended {outcome} {details!r}")
