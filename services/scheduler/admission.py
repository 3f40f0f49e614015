"""Checks a Submit must pass before its request may enter the queue, and the limits they use.

The sampling fields go through the checks the frontend applies (``services.common.request_checks``), so a
request sent straight to ``Scheduler.Submit`` or ``Connect`` is held to the public API's rules."""

from __future__ import annotations

import time
import uuid
from collections.abc import Container
from dataclasses import dataclass

from kvgrid.v1 import scheduler_pb2
from services.common.block_hash import cache_salt
from services.common.errors import AlreadyExists, InvalidArgument, ResourceExhausted
from services.common.pooling import check_resolved, check_runner
from services.common.request_checks import check_sampling_fields
from services.scheduler.convert import stop_conditions_from_proto
from services.scheduler.kv_cache_manager import cdiv
from services.scheduler.request import Request, StopConditions


@dataclass(slots=True)
class AdmissionLimits:
    max_model_len: int
    num_blocks: int
    block_size: int
    vocab_size: int
    max_waiting_requests: int
    window_fits: bool = False  # blocks behind a sliding window are freed: a prompt longer than the pool fits
    pooling: bool = False  # the worker is a pooling runner: pooling requests only (and only they)
    takes_images: bool = False  # the worker serves a vision-language model
    lora: bool = False  # the worker serves LoRA adapters (--enable-lora)

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size


def admit(msg: scheduler_pb2.SubmitRequest, limits: AdmissionLimits, live: Container[str], num_waiting: int) -> Request:
    """A Request for a valid Submit; raises InvalidArgument, AlreadyExists or ResourceExhausted otherwise."""
    request_id = msg.request_id or uuid.uuid4().hex
    if request_id in live:
        raise AlreadyExists(f"request_id: a live request already has id {request_id!r}")
    pooling = msg.pooling if msg.HasField("pooling") else None
    check_runner("pooling", pooling is not None, limits.pooling)
    if pooling is not None:
        check_resolved(pooling)
    check_sampling_fields(msg.sampling, limits.max_model_len, limits.vocab_size or 2**32)
    lora = msg.lora if msg.HasField("lora") else None
    if lora is not None and not (limits.lora and lora.name and lora.path):
        why = "needs a name and a path" if limits.lora else "this server runs no LoRA adapters (--enable-lora)"
        raise InvalidArgument("lora", why)
    prompt = list(msg.prompt_token_ids)
    num_prompt = len(prompt)
    if not num_prompt:
        raise InvalidArgument("prompt_token_ids", "must hold at least one token")
    if limits.vocab_size and max(prompt) >= limits.vocab_size:
        raise InvalidArgument(
            "prompt_token_ids", f"token id {max(prompt)} is outside the vocabulary (size {limits.vocab_size})"
        )
    if num_prompt >= limits.max_model_len:
        raise InvalidArgument(
            "prompt_token_ids",
            f"the prompt has {num_prompt} tokens but the maximum model length is {limits.max_model_len}, "
            "which leaves no room for output",
        )
    if num_prompt >= limits.pool_tokens and not limits.window_fits:
        raise ResourceExhausted(
            f"prompt_token_ids: the prompt has {num_prompt} tokens and needs {cdiv(num_prompt + 1, limits.block_size)}"
            f" KV blocks of {limits.block_size} tokens, but the worker's whole pool has {limits.num_blocks}"
        )
    if msg.mm_inputs and not limits.takes_images:
        raise InvalidArgument("mm_inputs", "the served model takes text only, no images")
    spans = mm_spans(msg, num_prompt)
    if num_waiting >= limits.max_waiting_requests:
        raise ResourceExhausted(f"the waiting queue is full ({num_waiting} requests); retry later")
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        # A pooling request's one "output" is its vector: planned like a single sampled token, never a decode.
        stop=StopConditions(max_tokens=1) if pooling is not None else stop_conditions_from_proto(msg.sampling),
        sampling=msg.sampling,
        priority=msg.priority,
        arrival_time=time.monotonic(),
        wants_prompt_logprobs=msg.sampling.HasField("prompt_logprobs"),
        pooling=pooling,
        skip_prefix_cache=pooling is not None and pooling.pooling_type != "last",
        mm_inputs=list(msg.mm_inputs),
        mm_spans=spans,
        lora=lora,
        lora_name=lora.name if lora is not None else "",
        cache_salt=cache_salt(lora.name) if lora is not None else None,
    )


def mm_spans(msg: scheduler_pb2.SubmitRequest, num_prompt: int) -> list[tuple[int, int, str]]:
    """The images' placeholder runs (offset, length, hash): in prompt order, within the prompt, not overlapping."""
    spans, end = [], 0
    for i, image in enumerate(msg.mm_inputs):
        if not image.mm_hash or not image.length or image.offset < end or image.offset + image.length > num_prompt:
            raise InvalidArgument(
                f"mm_inputs[{i}]", "an image needs a hash and a run of placeholders within the prompt, after the last"
            )
        spans.append((image.offset, image.length, image.mm_hash))
        end = image.offset + image.length
    return spans
