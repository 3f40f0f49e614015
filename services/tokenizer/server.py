"""Assemble the frontend: gRPC TextGeneration + health + reflection, the HTTP app (OpenAI API, /health,
/metrics), and the one engine client both hand requests to (a Router over every scheduler group)."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass

import grpc

from kvgrid.v1 import generate_pb2_grpc
from services.common.auth import ApiKeyInterceptor, ApiKeys
from services.common.config import (
    ChatConfig,
    Config,
    HttpConfig,
    LimitsConfig,
    ResponsesConfig,
    RoutingConfig,
    SecurityConfig,
)
from services.common.logs import setup_logging
from services.common.metrics import exposition_registry
from services.common.server import Health, add_reflection, bind, new_server, shutdown_requested
from services.common.tls import (
    describe_internal,
    describe_public,
    internal_tls,
    public_tls,
    server_credentials,
    uvicorn_ssl_options,
)
from services.common.tracing import setup_tracing, shutdown_tracing
from services.tokenizer.lora_registry import LoraRegistry
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.model_state import ModelState
from services.tokenizer.multimodal.media import MediaPolicy
from services.tokenizer.openai.app import build_app
from services.tokenizer.openai.guards import HttpGuards
from services.tokenizer.openai.http_server import HttpServer
from services.tokenizer.openai.responses_api.store import ResponseStore
from services.tokenizer.openai.serving import OpenAIServing
from services.tokenizer.openai.tools.support import ToolSupport
from services.tokenizer.openai.tools.templates import read_chat_template
from services.tokenizer.router import Router
from services.tokenizer.servicer import TextGenerationServicer
from services.tokenizer.text_tokenizer import TextTokenizer, read_tokenizer_dir

log = logging.getLogger(__name__)

SERVICE_NAME = "kvgrid.v1.TextGeneration"


def load_tokenizer(path: str) -> TextTokenizer:
    """--tokenizer: an HF tokenizer (or model) directory, or a GGUF file."""
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        from services.tokenizer.gguf_tokenizer import read_gguf_tokenizer

        return TextTokenizer.from_files(read_gguf_tokenizer(path))
    return TextTokenizer.from_files(read_tokenizer_dir(path))


@dataclass(slots=True)
class TokenizerServer:
    server: grpc.aio.Server
    http: HttpServer
    engine: Router
    state: ModelState
    health: Health
    metrics: TokenizerMetrics
    port: int
    http_port: int

    async def stop(self, grace: float = 5.0) -> None:
        """Report NOT_SERVING and refuse new requests (UNAVAILABLE, with a reason), let the streams in flight
        finish for up to ``grace`` seconds, then close everything (what is still running is cancelled)."""
        self.state.drain()
        left = await self.state.wait_streams_done(grace)
        if left:
            log.warning("%d streams still running after the %gs shutdown grace; cancelling them", left, grace)
        # The streams are done (or out of time): a second for their last messages and status to reach the clients
        # (a finished handler's writes may still be queued; stop(0) would cancel them) and for idle keep-alive HTTP
        # connections to close.
        await asyncio.gather(self.server.stop(1.0), self.http.close(1.0))
        await self.engine.close()

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def start_tokenizer(
    config: Config, port: int = 0, http_port: int = 0, tokenizer: TextTokenizer | None = None
) -> TokenizerServer:
    """Start serving on ``config.network.host``; port 0 picks free ports (see the returned ports). Raises OSError
    (a port taken) or ValueError (unreadable key or certificate files)."""
    security = config.security or SecurityConfig()
    limits = config.limits or LimitsConfig()
    keys = ApiKeys.from_config(security)
    public = server_credentials(public_tls(security))
    internal = internal_tls(security)
    if tokenizer is None and config.model.tokenizer:
        tokenizer = load_tokenizer(config.model.tokenizer)
        log.info("tokenizer loaded from %s", config.model.tokenizer)
    http_config = config.http or HttpConfig()
    shared = http_config.api_server_count > 1  # one of a group of processes on the same ports
    metrics = TokenizerMetrics(config.model.name)
    interceptors = [ApiKeyInterceptor(keys)] if keys is not None else []
    server = new_server(interceptors, max_receive_bytes=limits.max_request_bytes, reuse_port=shared)
    health = Health(server, [SERVICE_NAME])
    routing = config.routing or RoutingConfig()
    addrs = config.network.scheduler_addr_list()
    serving = asyncio.Event()

    def on_change(up: bool) -> None:
        health.set(up)
        serving.set() if up else serving.clear()

    chat = config.chat or ChatConfig()
    state = ModelState(
        ", ".join(addrs),
        tokenizer=tokenizer,
        served_model_name=config.model.served_model_name,
        on_change=on_change,
        max_prompt_chars=limits.max_prompt_chars,
        tools=ToolSupport.named(chat.tool_call_parser),
        chat_template=read_chat_template(chat.chat_template) if chat.chat_template else "",
        media=MediaPolicy.from_limits(limits),
        trust_request_chat_template=chat.trust_request_chat_template,
    )
    state.loras = LoraRegistry(config.lora)
    engine = Router(addrs, state, routing, internal)
    generate_pb2_grpc.add_TextGenerationServicer_to_server(TextGenerationServicer(state, engine, metrics), server)
    add_reflection(server, [SERVICE_NAME])
    guards = HttpGuards(keys, security.metrics_require_key, limits.max_request_bytes)
    registry = exposition_registry(metrics.registry)
    store = ResponseStore.from_config(config.responses or ResponsesConfig())
    app = build_app(OpenAIServing(state, engine, metrics), registry, lambda: state.serving, guards, store)
    http = HttpServer(app, http_config, uvicorn_ssl_options(security))
    if shared:
        # A process joins the group's ports only once it can serve: the kernel hands a listening socket its share of
        # new connections at once, and a (re)starting process would refuse them until its scheduler link is up.
        await engine.start()
        log.info("one of %d frontends on shared ports: listening once serving", http_config.api_server_count)
        await serving.wait()
    bound = bind(server, config.network.host, port, public)
    await server.start()
    try:
        bound_http = await http.start(config.network.host, http_port, reuse_port=shared)
    except OSError:
        await server.stop(None)
        raise
    if not shared:
        await engine.start()
    if keys is None:
        auth = "no API key: open to every client"
    else:
        metrics_auth = "/metrics too" if security.metrics_require_key else "/health and /metrics open"
        auth = f"API key required ({len(keys)} accepted; {metrics_auth})"
    log.info(
        "tokenizer frontend on %s: gRPC %d, HTTP %d (%s; %s; largest request %d bytes)",
        config.network.host,
        bound,
        bound_http,
        describe_public(security),
        auth,
        limits.max_request_bytes,
    )
    log.info(
        "schedulers at %s (%s routing; %s)",
        ", ".join(engine.groups),
        routing.routing_policy,
        describe_internal(security),
    )
    return TokenizerServer(server, http, engine, state, health, metrics, bound, bound_http)


log = logging.getLogger("services.tokenizer")


async def _serve(config: Config) -> int:
    net = config.network
    try:
        server = await start_tokenizer(config, port=net.tokenizer_port, http_port=net.http_port)
    except (OSError, ValueError) as e:
        log.error("cannot start the tokenizer frontend: %s", e)
        return 1
    stop = shutdown_requested()
    await stop.wait()
    grace = config.lifecycle.shutdown_grace
    log.info("shutting down: NOT_SERVING, refusing new requests, finishing running streams for up to %gs", grace)
    await server.stop(grace)
    return 0


def main(config: Config) -> int:
    obs = config.observability
    setup_logging("tokenizer", obs.log_level, obs.log_format)
    setup_tracing("kvgrid-tokenizer")
    try:
        return asyncio.run(_serve(config))
    finally:
        shutdown_tracing()
