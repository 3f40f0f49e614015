"""Everything a serving worker holds once ready: the runner and the handshake reply, built from the config."""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass, replace

from kvgrid.v1 import worker_pb2
from services.common import kv_keys
from services.common.config import Config
from services.common.default_model import resolve_model
from services.common.errors import InvalidArgument
from services.common.speculative import SpeculativeConfig
from services.worker.kv_transfer import HostTier, KvTransfer, RedisTier
from services.worker.kv_transfer.blocks import block_shape
from services.worker.kv_transfer.transfer import Fetches
from services.worker.lora.manager import LoraManager, build_lora_manager
from services.worker.metrics import WorkerMetrics
from services.worker.model_runner import ModelRunner, SampledRow
from services.worker.multimodal.config import multimodal_config
from services.worker.parallel.plan import describe, load_rank, plan_rank, tensor_parallel_size, world_size
from services.worker.parallel.ranks import Ranks, start_ranks
from services.worker.parallel.stages import StagedModel
from services.worker.request_state import RequestState, RequestStates
from services.worker.sampling.request_sampling import RequestSampling
from services.worker.sampling.structured import GrammarCache
from services.worker.setup.build import LoadedModel, create_runner, max_model_len
from services.worker.setup.loader import ModelLoadError, eos_token_ids, load_tokenizer, tokenizer_files
from services.worker.setup.memory import MemoryFigures, bytes_per_block
from services.worker.spec_decode.decoder import SpecDecoder
from services.worker.spec_decode.draft_model import DraftModelProposer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerCore:
    runner: ModelRunner
    handshake: worker_pb2.HandshakeResponse
    seed: int | None
    grammars: GrammarCache
    ranks: Ranks | None = None  # a worker group (tensor/pipeline parallel): ranks 1..N-1, fed each step by the runner
    # Moves blocks to and from the KV tiers (--kv-tiers); None when they are off.
    kv_transfer: KvTransfer | None = None

    @property
    def max_model_len(self) -> int:
        return self.handshake.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.handshake.vocab_size

    def check_plan(self, plan: worker_pb2.StepPlan) -> None:
        """The plan's KV tier moves, checked before the request states apply it; raises InvalidArgument."""
        if self.kv_transfer is not None:
            self.kv_transfer.check(plan)
        elif plan.kv_saves or any(new.kv_loads for new in plan.new_requests):
            raise InvalidArgument("kv_saves", "this worker serves no KV tiers (--kv-tiers)")

    @property
    def fetches_ahead(self) -> bool:
        """Whether plans have KV tier loads worth starting before their turn (``prefetch``): Redis round trips."""
        return self.kv_transfer is not None and self.kv_transfer.redis is not None

    def prefetch(self, plan: worker_pb2.StepPlan) -> Fetches | None:
        """Start fetching the plan's Redis loads (any time before ``execute``: nothing in the cache is touched)."""
        return self.kv_transfer.prefetch(plan) if self.kv_transfer is not None else None

    def execute(
        self, plan: worker_pb2.StepPlan, scheduled: list[RequestState], fetches: Fetches | None = None
    ) -> tuple[list[SampledRow], int]:
        """The plan's KV tier moves (Redis loads from ``fetches`` where ``prefetch`` started them), then its step (or
        steps); also returns the tokens planned as loads that were computed."""
        num_failed = self.kv_transfer.apply(plan, scheduled, fetches) if self.kv_transfer is not None else 0
        if plan.num_steps > 1:
            return self.runner.execute_steps(scheduled, plan.num_steps), num_failed
        return self.runner.execute(scheduled), num_failed

    def request_states(self) -> RequestStates:
        """Empty per-request state for one plan stream (the Execute stream, or an offline engine)."""
        seed, eos = self.seed, tuple(self.handshake.eos_token_ids)

        def make_sampling(params, prompt, outputs) -> RequestSampling:
            # EOS (unless ignore_eos) and stop tokens are banned until min_tokens have been generated.
            constraint = self.grammars.constraint(params, outputs)
            return RequestSampling.create(
                params, prompt, outputs, default_seed=seed, eos_token_ids=eos, constraint=constraint
            )

        return RequestStates(
            self.runner.block_size,
            self.runner.num_blocks,
            self.vocab_size,
            self.max_model_len,
            make_sampling,
            pooling=self.handshake.HasField("pooler"),
            takes_images=self.runner.encoder_cache is not None,
            lora=self.handshake.max_loras > 0,
        )


def build_core(config: Config, metrics: WorkerMetrics | None = None, worker_id: str | None = None) -> WorkerCore:
    """Load, profile, allocate. Raises ModelLoadError or InsufficientMemory with a one-line reason."""
    try:
        model_path = resolve_model(config.model.model)
    except FileNotFoundError as exc:
        raise ModelLoadError(str(exc)) from exc
    size, tp = world_size(config), tensor_parallel_size(config)
    ranks = None
    if size > 1:
        ranks, model_path = start_ranks(config, model_path)
    try:
        group = ranks.join_group() if ranks is not None else None
        loaded = load_rank(config, ranks.plan.layers if ranks else None, model_path, 0, group)
        tokenizer = load_tokenizer(loaded.source)
        max_len = max_model_len(loaded.args, loaded.hf_config, config.model.max_model_len)
        kv_cache_memory = ranks.plan.kv_cache_memory if ranks is not None else config.cache.kv_cache_memory
        lora = build_lora(config, loaded, size)
        figures = plan_rank(config, loaded, max_len, kv_cache_memory, group)
        runner = create_runner(loaded, config.cache.block_size, figures.num_blocks, config.model.seed)
        runner.lora = lora
    except BaseException:
        if ranks is not None:
            ranks.kill()
        raise
    block_size = config.cache.block_size
    if ranks is not None:
        if ranks.plan.layers:
            runner.model = StagedModel(runner.model, group)
        ranks.drive(runner)
        log.info("decode steps run eagerly: no CUDA graphs with %s", describe(config))
    elif loaded.device.type == "cuda" and loaded.attention_backend == "triton":
        if lora is not None:
            log.info("decode steps run eagerly: no CUDA graphs with --enable-lora")
        elif config.device.enforce_eager:
            log.info("decode steps run eagerly (--enforce-eager): no CUDA graphs")
        else:
            runner.use_decode_graphs(config.scheduler.max_num_seqs, max_len)
    log.info(
        "KV cache: %d blocks of %d tokens (%.1f MiB, %s)",
        figures.num_blocks,
        block_size,
        figures.kv_cache_bytes / 2**20,
        figures.method,
    )
    handshake = worker_pb2.HandshakeResponse(
        model=config.model.name,
        architecture=loaded.args.architecture,
        dtype=str(loaded.dtype).removeprefix("torch."),
        device=str(loaded.device),
        block_size=block_size,
        num_blocks=figures.num_blocks,
        bytes_per_block=group_block_bytes(loaded, block_size, tp),  # every stage's layers, all ranks' KV heads
        max_model_len=max_len,
        vocab_size=loaded.args.vocab_size,
        eos_token_ids=eos_token_ids(loaded.source, loaded.hf_config, tokenizer),
        memory=memory_profile(figures),
        tokenizer_files=tokenizer_files(tokenizer),
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        max_num_seqs=config.scheduler.max_num_seqs,
        worker_id=worker_id or uuid.uuid4().hex,
        load_seconds=loaded.load_seconds,
        sliding_window=loaded.args.freeing_window,
        multimodal_config=multimodal_config(loaded.args, loaded.source.path, tokenizer),
        max_loras=0 if lora is None else lora.max_loras,
    )
    if config.model.runner == "pooling":
        handshake.pooler.CopyFrom(
            worker_pb2.PoolerConfig(
                pooling_type=config.model.pooling_type,
                normalize=config.model.normalize,
                hidden_size=loaded.args.hidden_size,
            )
        )
        log.info("pooling runner: %s pooling, normalize %s", config.model.pooling_type, config.model.normalize)
    if metrics is not None:
        record_metrics(metrics, loaded, figures)
        if runner.encoder_cache is not None:
            metrics.watch_encoder_cache(runner.encoder_cache)
    runner.spec = build_spec_decoder(config, metrics, loaded, runner, size)
    grammars = grammar_cache(handshake)
    transfer = build_kv_transfer(config, runner, handshake, metrics)
    if ranks is not None and ranks.plan.layers and transfer is None:
        handshake.micro_batches = len(ranks.plan.layers)  # see services/worker/parallel/micro_batches.py
    return WorkerCore(runner, handshake, config.model.seed, grammars, ranks, transfer)


def group_block_bytes(loaded: LoadedModel, block_size: int, tp: int) -> int:
    """One block of the whole model's cache: all layers (every stage's), all KV heads (every shard's)."""
    a = loaded.args
    num_layers = loaded.hf_config.get_text_config().num_hidden_layers  # a vision model: its language model's
    return bytes_per_block(num_layers, block_size, a.num_kv_heads * tp, a.head_dim, loaded.dtype.itemsize)


def build_kv_transfer(
    config: Config, runner: ModelRunner, handshake: worker_pb2.HandshakeResponse, metrics: WorkerMetrics | None
) -> KvTransfer | None:
    """The tiers of --kv-tiers, announced in the handshake (host slots, tier names); None when off."""
    names = config.cache.kv_tier_names
    if not names:
        return None
    host = redis_tier = None
    if "host" in names:
        num_slots = config.cache.kv_host_memory // handshake.bytes_per_block
        if num_slots < 1:
            raise ModelLoadError(
                f"--kv-host-memory {config.cache.kv_host_memory} holds no KV block ({handshake.bytes_per_block} bytes)"
            )
        host = HostTier(runner.kv_caches, num_slots)
        host.start_prefault()  # in the background: the handshake does not wait for a big tier's pages
        handshake.num_host_blocks = num_slots
        log.info("host KV tier: %d blocks (%.1f MiB)", num_slots, num_slots * handshake.bytes_per_block / 2**20)
    if "redis" in names:
        import redis

        client = redis.Redis.from_url(config.cache.kv_redis_url, socket_timeout=5.0, socket_connect_timeout=1.0)
        ns = kv_keys.namespace(handshake.model, handshake.dtype, handshake.block_size, handshake.bytes_per_block)

        def on_failure(op: str) -> None:
            if metrics is not None:
                metrics.kv_tier_failures.labels(model=metrics.model, tier="redis", op=op).inc()

        k0 = runner.kv_caches[0][0]
        redis_tier = RedisTier(client, ns, block_shape(runner.kv_caches), k0.dtype, on_failure)
        redis_tier.start_prefault(-(-handshake.max_model_len // handshake.block_size))  # a full-length prompt's
        log.info("redis KV tier: %s", config.cache.kv_redis_url)
    handshake.kv_tiers.extend(names)
    return KvTransfer(runner.kv_caches, runner.block_size, host, redis_tier, metrics)


def build_spec_decoder(
    config: Config, metrics: WorkerMetrics | None, target: LoadedModel, runner: ModelRunner, tp_size: int
) -> SpecDecoder | None:
    """--speculative-config's proposer (loading the draft model for method draft_model); None when off."""
    spec = config.scheduler.speculative
    if spec is None:
        return None
    draft = None
    if spec.method == "draft_model":
        draft = load_draft(config, spec, target, runner, tp_size)
        method = f"draft model {spec.model}" + (f" ({spec.quantization})" if spec.quantization else "")
    else:
        method = f"ngram (prompt lookup {spec.prompt_lookup_min}..{spec.prompt_lookup_max})"
    log.info(
        "speculative decoding: %s, up to %d tokens, off above %s running requests",
        method,
        spec.num_speculative_tokens,
        spec.disable_by_batch_size or "any number of",
    )
    on_verified = metrics.spec_decode_recorder(spec.method) if metrics is not None else None
    return SpecDecoder(spec, on_verified, draft)


def load_draft(
    config: Config, spec: SpeculativeConfig, target: LoadedModel, runner: ModelRunner, tp_size: int
) -> DraftModelProposer:
    """The draft model with a KV cache of the target's block count and size (its own tensors), its weights as
    the config's ``quantization`` says (e.g. the target's own GGUF kept packed: a draft that agrees with the
    target nearly always and reads a fraction of its bytes)."""
    path = spec.model
    if tp_size > 1:
        raise ModelLoadError("--speculative-config: method draft_model is not served with --tensor-parallel-size > 1")
    if not os.path.exists(path):
        raise ModelLoadError(f"--speculative-config: draft model {path!r} does not exist")
    if spec.quantization:
        config = replace(config, load=replace(config.load, quantization=spec.quantization))
    draft = load_rank(config, None, path, 0, None)
    if draft.args.vocab_size != target.args.vocab_size:
        raise ModelLoadError(
            f"--speculative-config: the draft model's vocabulary ({draft.args.vocab_size} tokens) is not the "
            f"target's ({target.args.vocab_size}): the draft must share the target's tokenizer"
        )
    draft_runner = create_runner(draft, runner.block_size, runner.num_blocks)
    log.info(
        "draft model %s: %d layers, KV cache %.1f MiB beside the target's",
        path,
        draft.args.num_layers,
        draft.block_bytes(runner.block_size) * runner.num_blocks / 2**20,
    )
    return DraftModelProposer(draft_runner)


def build_lora(config: Config, loaded: LoadedModel, tp_size: int) -> LoraManager | None:
    """--enable-lora: the slot table on the model, whose steps then run on the torch path (see lora/manager.py)."""
    lora = config.lora
    if lora is None or not lora.enable_lora:
        return None
    if tp_size > 1:
        raise ModelLoadError("--enable-lora serves adapters on one device: use --tensor-parallel-size 1")
    if config.model.runner == "pooling":
        raise ModelLoadError("--enable-lora applies to generation: not with --runner pooling")
    model = loaded.model
    projections = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    layer = model.layers[0]
    if not all(hasattr(layer.self_attn if p in projections[:2] else layer.mlp, p) for p in projections):
        raise ModelLoadError(f"--enable-lora serves the Llama family's projections, not {loaded.args.architecture}'s")
    if model.native_path is not None:
        if config.device.cpu_kernels == "native":
            raise ModelLoadError("--cpu-kernels native has no LoRA products: use --cpu-kernels auto or torch")
        model.set_native_path(None)
        log.info("steps run in torch: the native CPU kernels apply no LoRA adapters (--enable-lora)")
    if getattr(model, "decode_call", None) is not None:  # Gemma 3's one-call decode steps: no LoRA products either
        model.decode_call = None
    return build_lora_manager(model, lora.max_loras, lora.max_cpu_loras or lora.max_loras, lora.max_lora_rank)


def grammar_cache(handshake: worker_pb2.HandshakeResponse) -> GrammarCache:
    """Structured outputs compile against the same tokenizer.json the frontend is built from."""
    tokenizer_json = handshake.tokenizer_files.get("tokenizer.json", b"").decode("utf-8")  # the frontend needs it too
    return GrammarCache(tokenizer_json, handshake.vocab_size, list(handshake.eos_token_ids))


def memory_profile(f: MemoryFigures) -> worker_pb2.MemoryProfile:
    return worker_pb2.MemoryProfile(
        method=f.method,
        total_bytes=f.total_bytes,
        weights_bytes=f.weights_bytes,
        peak_activation_bytes=f.peak_activation_bytes,
        non_torch_bytes=f.non_torch_bytes,
        kv_cache_bytes=f.kv_cache_bytes,
        gpu_memory_utilization=f.gpu_memory_utilization,
    )


def record_metrics(metrics: WorkerMetrics, loaded: LoadedModel, f: MemoryFigures) -> None:
    metrics.num_blocks.set(f.num_blocks)
    metrics.model_load_seconds.set(loaded.load_seconds)
    metrics.set_profile(
        total=f.total_bytes,
        weights=f.weights_bytes,
        peak_activation=f.peak_activation_bytes,
        non_torch=f.non_torch_bytes,
        kv_cache=f.kv_cache_bytes,
    )
