"""Many Generate streams at once, each read on its own thread: tokens so far, how it ended, and its status."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "cats", "watch"]


def prompt(i: int) -> str:
    """Distinct prompts of mixed lengths."""
    return " ".join(WORDS[: 2 + (i * 5) % len(WORDS)] * (1 + i % 3)) + f" ({i})"


def greedy(i: int, max_tokens: int) -> generate_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return generate_pb2.GenerateRequest(prompt=prompt(i), sampling=sampling, request_id=f"g{i}-{time.time_ns()}")


def seeded(i: int, max_tokens: int) -> generate_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, seed=1000 + i)
    return generate_pb2.GenerateRequest(prompt=prompt(i), sampling=sampling, request_id=f"s{i}-{time.time_ns()}")


@dataclass
class Outcome:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    code: grpc.StatusCode | None = None
    details: str = ""
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def ok(self) -> bool:
        return self.done.is_set() and self.code is None and bool(self.finish_reason)


class Streams:
    """Start ``requests`` at once against ``addr``; ``wait`` for them to end."""

    def __init__(self, addr: str, requests: list[generate_pb2.GenerateRequest], timeout: float = 300):
        self.channel = grpc.insecure_channel(addr)
        self.stub = generate_pb2_grpc.TextGenerationStub(self.channel)
        self.outcomes = [Outcome() for _ in requests]
        self.calls: list = [None] * len(requests)
        self._threads = [
            threading.Thread(target=self._read, args=(i, r, timeout), daemon=True) for i, r in enumerate(requests)
        ]
        for thread in self._threads:
            thread.start()

    def _read(self, i: int, request, timeout: float) -> None:
        out = self.outcomes[i]
        try:
            call = self.calls[i] = self.stub.Generate(request, timeout=timeout)
            for response in call:
                out.token_ids.extend(response.token_ids)
                out.text += response.text
                out.finish_reason = out.finish_reason or response.finish_reason
        except grpc.RpcError as e:
            out.code, out.details = e.code(), e.details() or ""
        finally:
            out.done.set()

    def wait_tokens(self, min_tokens: int, timeout: float = 240) -> int:
        """Until every stream has ``min_tokens`` or ended; returns how many are still running."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(o.done.is_set() or len(o.token_ids) >= min_tokens for o in self.outcomes):
                break
            time.sleep(0.02)
        return sum(not o.done.is_set() for o in self.outcomes)

    def wait(self, timeout: float = 300) -> list[Outcome]:
        for thread in self._threads:
            thread.join(timeout)
        self.channel.close()
        return self.outcomes
