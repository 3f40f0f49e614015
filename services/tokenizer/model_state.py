"""What the frontend knows about the served model: the tokenizer and the worker's handshake.

The frontend serves only once it has both and the scheduler is SERVING; every
change of that flips the gRPC health status and /health through ``on_change``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from kvgrid.v1 import generate_pb2, worker_pb2
from services.common.errors import Unavailable
from services.common.pooling import TASKS, runner_of
from services.tokenizer.frontdoor import FrontDoor
from services.tokenizer.grammar_check import GrammarChecker
from services.tokenizer.lora_registry import LoraRegistry
from services.tokenizer.multimodal.images import ImageInputs, ImageSpec
from services.tokenizer.multimodal.media import MediaPolicy
from services.tokenizer.openai.tools.support import ToolSupport
from services.tokenizer.text_tokenizer import TextTokenizer
from services.tokenizer.validation import ModelLimits

log = logging.getLogger(__name__)

T = TypeVar("T")


class ModelState:
    def __init__(
        self,
        scheduler_addr: str,
        tokenizer: TextTokenizer | None = None,
        served_model_name: str = "",
        on_change: Callable[[bool], None] = lambda serving: None,
        max_prompt_chars: int = 0,
        tools: ToolSupport | None = None,
        chat_template: str = "",
        media: MediaPolicy | None = None,
        trust_request_chat_template: bool = False,
    ):
        """``max_prompt_chars``: --max-prompt-chars (0: from the worker's max_model_len, see ``ModelLimits``);
        ``tools``: the tool-call parser and its template (--tool-call-parser); ``chat_template``: the source of
        --chat-template, which replaces the model's own ('' keeps it); ``trust_request_chat_template``: a chat
        may bring its own (--trust-request-chat-template)."""
        self.trust_request_chat_template = trust_request_chat_template
        self.scheduler_addr = scheduler_addr
        self._chat_template = chat_template
        self.media = media or MediaPolicy()  # where images may come from, and their limits
        if tokenizer is not None and chat_template:
            tokenizer.use_chat_template(chat_template)
        self.tokenizer = tokenizer
        self.tools = tools or ToolSupport.named()
        self.info: worker_pb2.HandshakeResponse | None = None
        self.scheduler_serving = False
        # Set once shutdown begins: never serving again, whatever the scheduler says.
        self.draining = False
        self._override = tokenizer is not None  # --tokenizer given: the worker's files are not used
        self._files: dict[str, bytes] = {}
        self._served_model_name = served_model_name
        self.loras = LoraRegistry()  # the LoRA adapters requests may name (--enable-lora); the server sets its own
        self._on_change = on_change
        # Generation streams in flight (gRPC and HTTP alike), so that a drain knows when they are done.
        self._num_streams = 0
        self._no_streams = asyncio.Event()
        self._no_streams.set()
        self._grammars = GrammarChecker()
        self._grammars_for: tuple = ()  # (tokenizer, vocab size, EOS ids) the checker was built for
        self._max_prompt_chars = max_prompt_chars

    @property
    def serving(self) -> bool:
        return self.tokenizer is not None and self.info is not None and self.scheduler_serving and not self.draining

    async def set_worker_info(self, info: worker_pb2.HandshakeResponse) -> None:
        """A (possibly new) worker's handshake; rebuilds the tokenizer when its files changed."""
        files = dict(info.tokenizer_files)
        if not self._override and files != self._files:
            if not files:
                raise ValueError("the worker sent no tokenizer files; start the frontend with --tokenizer PATH")
            tokenizer = await asyncio.to_thread(TextTokenizer.from_files, files)
            if self._chat_template:
                tokenizer.use_chat_template(self._chat_template)
            self.tokenizer = tokenizer
            self._files = files
            log.info("tokenizer loaded from the worker's files (%s)", ", ".join(sorted(files)))
        await self._build_grammar_checker(info)
        if self.info is None or self.info.worker_id != info.worker_id:
            log.info(
                "worker %s: model %s, max_model_len %d, %d KV blocks of %d tokens on %s",
                info.worker_id or "?",
                info.model,
                info.max_model_len,
                info.num_blocks,
                info.block_size,
                info.device,
            )
        was = self.serving
        self.info = info
        self._notify(was)

    async def _build_grammar_checker(self, info: worker_pb2.HandshakeResponse) -> None:
        tokenizer = self.tokenizer
        vocab_size = info.vocab_size or tokenizer.vocab_size
        basis = (tokenizer, vocab_size, tuple(info.eos_token_ids))
        if basis != self._grammars_for:
            json_text = tokenizer.to_json()
            self._grammars = await asyncio.to_thread(GrammarChecker.build, json_text, vocab_size, info.eos_token_ids)
            self._grammars_for = basis
            if self._grammars.unavailable:
                log.warning("structured outputs are unavailable: %s", self._grammars.unavailable)

    def set_scheduler_serving(self, serving: bool) -> None:
        was = self.serving
        self.scheduler_serving = serving
        self._notify(was)

    def drain(self) -> None:
        """Shutdown began: report NOT_SERVING (gRPC health and /health) and refuse new requests with UNAVAILABLE
        while running streams finish."""
        was = self.serving
        self.draining = True
        self._notify(was)

    async def counted(self, stream: AsyncIterator[T]) -> AsyncIterator[T]:
        """``stream``, counted among the streams a drain waits for (gRPC and HTTP alike) until it ends."""
        self.stream_started()
        try:
            async for item in stream:
                yield item
        finally:
            await stream.aclose()
            self.stream_ended()

    def stream_started(self) -> None:
        """Call when a generation stream starts, and ``stream_ended`` when it ends: a drain waits for them."""
        self._num_streams += 1
        self._no_streams.clear()

    def stream_ended(self) -> None:
        self._num_streams -= 1
        if self._num_streams == 0:
            self._no_streams.set()

    async def wait_streams_done(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for the streams in flight to end; returns how many are left."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._no_streams.wait(), timeout)
        return self._num_streams

    def _notify(self, was: bool) -> None:
        if self.serving != was:
            log.info("frontend is %s", "SERVING" if self.serving else "NOT_SERVING")
            self._on_change(self.serving)

    def require_tokenizer(self) -> TextTokenizer:
        if self.tokenizer is None:
            raise Unavailable(f"no tokenizer yet: waiting for the worker's handshake via {self.scheduler_addr}")
        return self.tokenizer

    def require_info(self) -> worker_pb2.HandshakeResponse:
        if self.info is None:
            raise Unavailable(f"no model information yet: waiting for the scheduler at {self.scheduler_addr}")
        return self.info

    def require_serving(self) -> tuple[TextTokenizer, ModelLimits]:
        if self.draining:
            raise Unavailable("this frontend is shutting down and takes no new requests; retry on another replica")
        tokenizer, _ = self.require_tokenizer(), self.require_info()
        if not self.scheduler_serving:
            raise Unavailable(f"the scheduler at {self.scheduler_addr} is not serving")
        return tokenizer, self.limits()

    def front_door(self) -> FrontDoor:
        """The front door for a new request; UNAVAILABLE unless serving."""
        tokenizer, limits = self.require_serving()
        info = self.require_info()
        images = ImageInputs(ImageSpec.from_json(info.multimodal_config), self.media)
        pooler = info.pooler if info.HasField("pooler") else None
        return FrontDoor(
            tokenizer, limits, pooler, self.tools, images, trust_request_chat_template=self.trust_request_chat_template
        )

    def max_prompt_chars(self) -> int | None:
        """The prompt cap in characters once the model is known (None before: the front door's default)."""
        return self.limits().max_prompt_chars if self.info is not None and self.tokenizer is not None else None

    def limits(self) -> ModelLimits:
        info = self.require_info()
        vocab_size = info.vocab_size or self.require_tokenizer().vocab_size
        return ModelLimits(info.max_model_len, vocab_size, self._grammars, self._max_prompt_chars)

    def model_info(self) -> generate_pb2.ModelInfo:
        info = self.require_info()
        return generate_pb2.ModelInfo(
            model=self._served_model_name or info.model,
            max_model_len=info.max_model_len,
            vocab_size=self.limits().vocab_size,
            num_kv_blocks=info.num_blocks,
            block_size=info.block_size,
            dtype=info.dtype,
            eos_token_ids=list(info.eos_token_ids),
            device=info.device,
            runner=runner_of(info),
            supported_tasks=TASKS[runner_of(info)],
        )
