"""Requests as a client sends them, and what the client saw of each."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc

REQUEST_TIMEOUT_S = 300.0


@dataclass(slots=True)
class Seen:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    # tokens of the first response that carried any (TTFT); each later token counts an inter-token latency
    num_first_tokens: int = 0
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    first_token: threading.Event = field(default_factory=threading.Event)


def generate(addr: str, prompt: str, max_tokens: int, request_id: str, metadata=(), seen: Seen | None = None) -> Seen:
    """Greedy, ignoring EOS (so the request ends by length after exactly ``max_tokens`` tokens)."""
    seen = seen or Seen(request_id)
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = generate_pb2.GenerateRequest(prompt=prompt, sampling=sampling, request_id=request_id)
    with grpc.insecure_channel(addr) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        for response in stub.Generate(request, metadata=list(metadata), timeout=REQUEST_TIMEOUT_S):
            if response.token_ids:
                if not seen.token_ids:
                    seen.num_first_tokens = len(response.token_ids)
                seen.token_ids += response.token_ids
                seen.first_token.set()
            if response.finish_reason:
                seen.finish_reason = response.finish_reason
                seen.prompt_tokens = response.usage.prompt_tokens
                seen.completion_tokens = response.usage.completion_tokens
                seen.cached_prompt_tokens = response.usage.cached_prompt_tokens
    return seen


def generate_concurrently(addr: str, prompts: dict[str, str], max_tokens: int) -> list[Seen]:
    """One request per ``request_id: prompt``, all in flight together."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(generate, addr, prompt, max_tokens, rid) for rid, prompt in prompts.items()]
        return [f.result() for f in futures]


def model_info(addr: str) -> generate_pb2.ModelInfo:
    with grpc.insecure_channel(addr) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        return stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=30)
