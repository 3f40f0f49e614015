"""``LLM``: kvgrid's scheduler core and model runner in the caller's process, for offline batches.

    from kvgrid import LLM, SamplingParams

    llm = LLM()  # the embedded SmolLM2-135M-Instruct; LLM(model="path/to/model", dtype="float32", ...)
    for out in llm.generate(["The capital of France is"], SamplingParams(max_tokens=32)):
        print(out.text)

No gRPC, no services, no threads of its own: ``generate`` feeds the requests to the
scheduler and steps the engine in a plain loop until every one has finished.
Validation, tokenization, chat templates, detokenization and stop strings are the
tokenizer frontend's modules, so a request gives the same tokens and text here as
through ``kvgrid serve``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvgrid.offline.engine import EngineStats, OfflineEngine
from kvgrid.offline.lora_request import LoRARequest
from kvgrid.offline.options import offline_config
from kvgrid.offline.outputs import OutputCollector, RequestOutput, request_output
from kvgrid.offline.pooling import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingParams,
    PoolingRequestOutput,
    run_pooling,
)
from kvgrid.offline.progress import Progress
from kvgrid.offline.sampling_params import SamplingParams
from kvgrid.offline.tool_calls import tool_request
from kvgrid.v1 import generate_pb2, scheduler_pb2
from services.common.config import Config
from services.common.errors import KvgridError
from services.scheduler.admission import admit
from services.scheduler.request import Request
from services.tokenizer import validation as v
from services.tokenizer.frontdoor import ChatPrompt, EngineRequest, FrontDoor, TextPrompt, TokensPrompt
from services.tokenizer.multimodal.images import ImageInputs, ImageSpec
from services.tokenizer.multimodal.media import MediaPolicy
from services.tokenizer.openai.tools.types import ToolRequest
from services.tokenizer.text_tokenizer import TextTokenizer, read_tokenizer_dir
from services.worker.core import build_core
from services.worker.setup.threads import set_math_threads

log = logging.getLogger(__name__)

# Text, token ids, or vLLM's {"prompt": text, "multi_modal_data": {"image": PIL image or a list of them}}.
Prompt = str | Sequence[int] | dict
Conversation = Sequence[dict]


@dataclass(slots=True)
class PreparedRequest:
    """A request through the front door, and the scheduler's request for it (under this LLM's own id)."""

    engine_request: EngineRequest
    request: Request


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        kv_cache_memory: int | str | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        **options: Any,
    ):
        """Options are the worker's and scheduler's flags (``max_num_seqs``, ``block_size``, ``device``, ...),
        with their defaults; None means the default. Loads the model and allocates the KV cache."""
        values = dict(
            model=model,
            dtype=dtype,
            max_model_len=max_model_len,
            kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            **options,
        )
        self._setup(offline_config(values))

    @classmethod
    def from_config(cls, config: Config) -> LLM:
        """An LLM from a parsed configuration (``kvgrid run-batch`` builds one from its flags)."""
        llm = cls.__new__(cls)
        llm._setup(config)
        return llm

    def _setup(self, config: Config) -> None:
        set_math_threads(config.device.num_threads)
        core = build_core(config)
        files = read_tokenizer_dir(config.model.tokenizer) if config.model.tokenizer else core.handshake.tokenizer_files
        self.tokenizer = TextTokenizer.from_files(dict(files))
        self.engine = OfflineEngine(core, config)
        self.model_name = config.model.name
        info = core.handshake
        limits = v.ModelLimits(
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size or self.tokenizer.vocab_size,
            max_prompt_chars=config.limits.max_prompt_chars if config.limits is not None else 0,
        )
        media = MediaPolicy.from_limits(config.limits) if config.limits is not None else MediaPolicy()
        images = ImageInputs(ImageSpec.from_json(info.multimodal_config), media)
        pooler = info.pooler if info.HasField("pooler") else None
        # The caller is the server's owner: a template of its own is trusted as --chat-template would be.
        self.front_door = FrontDoor(self.tokenizer, limits, pooler, images=images, trust_request_chat_template=True)
        self.max_lora_rank = config.lora.max_lora_rank if config.lora is not None else 0
        self._next_id = 0

    @property
    def max_model_len(self) -> int:
        return self.front_door.limits.max_model_len

    def stats(self) -> EngineStats:
        """Counters since this LLM was built: steps, preemptions, prefix-cache lookups and hits."""
        return self.engine.stats()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One result per prompt, in order. A prompt is text or a list of token ids; ``sampling_params`` is one
        for all prompts or one per prompt, and so is ``lora_request`` (the adapter to run with; an LLM built with
        ``enable_lora=True``). Every request is checked before any runs: ValueError names the first bad one."""
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = _per_prompt(sampling_params, len(prompts))
        loras = _per_prompt_lora(lora_request, len(prompts))
        prepared = [
            _indexed(i, self.prepare, p, s, lora)
            for i, (p, s, lora) in enumerate(zip(prompts, params, loras, strict=True))
        ]
        return self.run(prepared, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tools: Sequence[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of ``{"role", "content"}`` dicts) or a list of them, through the model's chat
        template with the assistant's turn opened; one result per conversation. ``tools`` and ``tool_choice``
        are OpenAI's (see docs/tools.md): a result's ``tool_calls`` are the calls the model made, in OpenAI's
        shape, and its ``text`` the rest of its answer. ``chat_template`` (Jinja text) replaces the model's
        template and ``chat_template_kwargs`` adds variables to it, as vLLM's ``LLM.chat``."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params = _per_prompt(sampling_params, len(conversations))
        tool_req = tool_request(tools, tool_choice, parallel_tool_calls)
        template = (chat_template, chat_template_kwargs)
        prepared = [
            _indexed(i, self.prepare_chat, c, s, tool_req, template)
            for i, (c, s) in enumerate(zip(conversations, params, strict=True))
        ]
        return self.run(prepared, use_tqdm)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt, in order (an LLM built with ``runner="pooling"``). A prompt is text or a list of
        token ids. Every prompt is checked before any runs: ValueError names the first bad one."""
        return [
            EmbeddingRequestOutput(rid, EmbeddingOutput(vector), ids)
            for rid, ids, vector in self._pool(prompts, pooling_params, use_tqdm)
        ]

    def encode(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """``embed`` with vLLM's ``PoolingRequestOutput``: each vector as a float32 tensor."""
        import torch

        return [
            PoolingRequestOutput(rid, PoolingOutput(torch.tensor(vector, dtype=torch.float32)), ids)
            for rid, ids, vector in self._pool(prompts, pooling_params, use_tqdm)
        ]

    def _pool(self, prompts, params: PoolingParams | None, use_tqdm: bool) -> list[tuple[str, list[int], list]]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        given = [
            TextPrompt(p, f"prompts[{i}]") if isinstance(p, str) else TokensPrompt(list(p), f"prompts[{i}]")
            for i, p in enumerate(prompts)
        ]
        try:
            prepared = self.front_door.prepare_pooling(given, (params or PoolingParams()).to_proto(), "pool")
            admitted = [self.admit(r).request for r in prepared]
        except KvgridError as e:
            raise ValueError(str(e)) from None
        vectors = run_pooling(self.engine, admitted, use_tqdm)
        return [(r.request_id, r.prompt_token_ids, v) for r, v in zip(admitted, vectors, strict=True)]

    def prepare(self, prompt: Prompt, params: SamplingParams, lora: LoRARequest | None = None) -> PreparedRequest:
        """Check and tokenize one prompt; ValueError with the frontend's message when the request is invalid."""
        if isinstance(prompt, dict):
            given = text_prompt(prompt)
        else:
            given = TextPrompt(prompt) if isinstance(prompt, str) else TokensPrompt(list(prompt))
        return self._through_front_door(given, params, lora)

    def prepare_chat(
        self,
        conversation: Conversation,
        params: SamplingParams,
        tools: ToolRequest | None = None,
        template: tuple[str | None, dict | None] = (None, None),
    ) -> PreparedRequest:
        """``template``: the conversation's own chat template and template variables (None: the model's, none)."""
        prompt = ChatPrompt(
            list(conversation), tools=tools, chat_template=template[0], chat_template_kwargs=template[1]
        )
        return self._through_front_door(prompt, params)

    def _through_front_door(self, prompt, params: SamplingParams, lora: LoRARequest | None = None) -> PreparedRequest:
        sampling = params.to_proto()
        try:
            engine_request = self.front_door.prepare(prompt, sampling, str(self._next_id))
            if lora is not None:
                engine_request.lora = lora.to_proto(self.max_lora_rank)
            return self.admit(engine_request)
        except KvgridError as e:
            raise ValueError(str(e)) from None

    def admit(self, engine_request: EngineRequest) -> PreparedRequest:
        """A front-door request as this LLM's next scheduler request (``kvgrid run-batch`` prepares its own).
        Raises KvgridError with the status the served scheduler would answer."""
        submit = scheduler_pb2.SubmitRequest(
            request_id=str(self._next_id),
            prompt_token_ids=engine_request.prompt_ids,
            sampling=engine_request.scheduler_sampling(),
            pooling=engine_request.pooling,
            mm_inputs=engine_request.mm_inputs,
            lora=engine_request.lora,
        )
        request = admit(submit, self.engine.admission, live=(), num_waiting=0)
        self._next_id += 1
        return PreparedRequest(engine_request, request)

    def run(self, prepared: Sequence[PreparedRequest], use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prepared requests to the end; results in the order given."""
        responses = self.run_responses(prepared, use_tqdm)
        return [request_output(p.engine_request, r) for p, r in zip(prepared, responses, strict=True)]

    def run_responses(
        self, prepared: Sequence[PreparedRequest], use_tqdm: bool = True
    ) -> list[generate_pb2.GenerateResponse]:
        """Run prepared requests to the end; each one's whole response as the served stack would stream it (text,
        token ids, logprobs, finish reason, usage), in the order given."""
        engine = self.engine
        pending = deque(prepared)
        index = {p.request.request_id: i for i, p in enumerate(prepared)}
        collectors: dict[str, OutputCollector] = {}
        results: list[generate_pb2.GenerateResponse | None] = [None] * len(prepared)
        progress = Progress(len(prepared), use_tqdm)
        try:
            while pending or engine.has_work():
                # The waiting queue is fed as it drains, so a long batch never meets the service's queue limit.
                while pending and engine.scheduler.num_waiting < engine.admission.max_waiting_requests:
                    p = pending.popleft()
                    rid = p.request.request_id
                    collectors[rid] = OutputCollector(self.tokenizer, rid, p.engine_request)
                    engine.add(p.request)
                for sampled in engine.step():
                    rid = sampled.request.request_id
                    collector = collectors.get(rid)
                    if collector is None:
                        continue  # a plan of several steps: a token after the stop string that ended it
                    collector.push(sampled)
                    if not collector.finished:
                        continue
                    if sampled.finish is None:  # a stop string ended it here: the scheduler still holds it
                        engine.abort(rid)
                    response = results[index[rid]] = collectors.pop(rid).response
                    progress.done(response.usage.prompt_tokens, response.usage.completion_tokens)
        finally:
            for rid in collectors:  # interrupted: leave nothing behind for the next call
                engine.abort(rid)
            progress.close()
        return results


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params: {len(params)} given for {n} prompts (give one, or one per prompt)")
    return params


def text_prompt(prompt: dict) -> TextPrompt:
    """vLLM's prompt dict: ``prompt`` text and its images in ``multi_modal_data``."""
    text = prompt.get("prompt")
    if not isinstance(text, str):
        raise ValueError('a prompt dict has the text in "prompt"')
    images = (prompt.get("multi_modal_data") or {}).get("image", [])
    return TextPrompt(text, images=list(images) if isinstance(images, list | tuple) else [images])


def _per_prompt_lora(lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    lora = list(lora)
    if len(lora) != n:
        raise ValueError(f"lora_request: {len(lora)} given for {n} prompts (give one, or one per prompt)")
    return lora


def _indexed(i: int, prepare, item, params, *extra) -> PreparedRequest:
    try:
        return prepare(item, params, *extra)
    except ValueError as e:
        raise ValueError(f"prompt {i}: {e}") from None
