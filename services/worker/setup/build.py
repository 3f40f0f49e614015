"""Putting a worker together without gRPC: device and dtype, model, memory plan, KV cache, runner.

Used by ``main`` (and ``server.start_worker``), the benchmark and other suites' parity tests.
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from services.worker.attention import get_backend
from services.worker.cpu_kernels.library import NativeKernelsUnavailable, attention_path
from services.worker.cpu_kernels.library import load as load_native_kernels
from services.worker.kv_cache import allocate_kv_cache
from services.worker.model_runner import ModelRunner, profile_cache_blocks
from services.worker.models.llama import LlamaArgs, LlamaForCausalLM
from services.worker.models.llama_cpu import NativeCpuPath, PagedDecode
from services.worker.multimodal.encoder_cache import DEFAULT_CACHE_BYTES
from services.worker.parallel.sharding import check_size, shard_args
from services.worker.parallel.stages import stage_args
from services.worker.quant.install import packed_bytes
from services.worker.sampling.sampler import Sampler
from services.worker.setup.cpu_features import detect as detect_cpu
from services.worker.setup.gguf_cache import cached_source
from services.worker.setup.loader import ModelLoadError, ModelSource, build_model, read_config, resolve_source
from services.worker.setup.memory import (
    MemoryFigures,
    bytes_per_block,
    check_fits,
    cpu_figures,
    cuda_figures,
    read_meminfo,
)

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(slots=True)
class LoadedModel:
    source: ModelSource
    hf_config: Any
    args: LlamaArgs
    model: LlamaForCausalLM
    dtype: torch.dtype
    device: torch.device
    load_seconds: float
    # CUDA: free device memory before the weights were loaded, so profiling counts only this worker's use.
    cuda_free_at_start: int | None = None

    @property
    def weights_bytes(self) -> int:
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return params + packed_bytes(self.model) + self.model.packed_gemm_bytes()

    @property
    def attention_backend(self) -> str:
        return self.model.layers[0].self_attn.backend.name

    def block_bytes(self, block_size: int) -> int:
        a = self.args
        return bytes_per_block(a.num_layers, block_size, a.num_kv_heads, a.head_dim, self.dtype.itemsize)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for but no CUDA device is available")
    device = torch.device(name)
    return (
        torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None else device
    )


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 where the hardware computes in it, else float16 (older GPUs) or float32 (CPU)."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if detect_cpu().bf16_units else torch.float32


def load_model(
    model_path: str,
    *,
    dtype: str = "auto",
    device: str = "auto",
    attention_backend: str = "auto",
    load_format: str = "auto",
    upcast_matmuls: bool | None = None,
    cpu_kernels: str = "auto",
    quantization: str = "none",
    tp_rank: int = 0,
    tp_size: int = 1,
    layers: tuple[int, int] | None = None,
) -> LoadedModel:
    """Raises ModelLoadError (one line) for a bad path, architecture or file.

    ``tp_rank`` of ``tp_size``: load only that rank's share of the weights (see ``parallel/sharding.py``);
    the returned ``args`` are the rank's shapes, so its KV cache holds only its KV heads. ``layers`` [start, end):
    only those decoder layers, a pipeline stage's (see ``parallel/stages.py``).

    ``upcast_matmuls`` (None: auto) multiplies half-precision weights in float32, which is what a
    CPU without bfloat16 units should do (see ``layers.linear.Linear``). ``cpu_kernels``: see
    ``attach_cpu_kernels``. ``quantization``: none, int8 or gguf (see ``quant/``), CPU only."""
    started = time.perf_counter()
    source = resolve_source(model_path, load_format)
    if quantization != "gguf":  # gguf keeps the file's own blocks: the dequantized cache is not what it reads
        source = cached_source(source)
    torch_device = resolve_device(device)
    free_at_start = torch.cuda.mem_get_info(torch_device)[0] if torch_device.type == "cuda" else None
    torch_dtype = resolve_dtype(dtype, torch_device)
    check_quantization(quantization, source, torch_device)
    hf_config, args = read_config(source)
    if tp_size > 1:
        try:
            check_size(args, tp_size)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
        args = shard_args(args, tp_size)
    if layers is not None:
        args = stage_args(args, layers)
    try:
        backend = get_backend(attention_backend, str(torch_device))
    except (RuntimeError, ValueError, ImportError) as exc:  # e.g. TritonUnavailable: triton on a CPU
        raise ModelLoadError(f"--attention-backend {attention_backend}: {exc}") from exc
    model = build_model(
        source, hf_config, args, backend, torch_dtype, torch_device, quantization, (tp_rank, tp_size), layers
    )
    if upcast_matmuls is None:
        upcast_matmuls = torch_device.type == "cpu" and torch_dtype != torch.float32 and not detect_cpu().bf16_units
    if upcast_matmuls:
        log.info("%s weights are multiplied in float32: this CPU has no bfloat16 units", torch_dtype)
    model.set_upcast_matmuls(upcast_matmuls)
    if torch_device.type == "cpu":
        log.info("packed GEMMs: %s", model.set_packed_gemms(bf16_units=detect_cpu().bf16_units))
    attach_cpu_kernels(model, cpu_kernels, torch_device, backend.name)
    if torch_device.type == "cpu":
        cpu = detect_cpu()
        log.info("CPU: %s; %s", cpu.describe(), cpu.fast_path(str(torch_dtype).removeprefix("torch."), quantization))
    seconds = time.perf_counter() - started
    log.info("loaded %s (%s, %s on %s) in %.1fs", model_path, args.architecture, torch_dtype, torch_device, seconds)
    return LoadedModel(source, hf_config, args, model, torch_dtype, torch_device, seconds, free_at_start)


def check_quantization(quantization: str, source: ModelSource, device: torch.device) -> None:
    if quantization == "none":
        return
    if device.type != "cpu":
        raise ModelLoadError(f"--quantization {quantization} runs on CPU; use --quantization none on {device}")
    if quantization == "gguf" and source.format != "gguf":
        raise ModelLoadError(
            f"--quantization gguf keeps a GGUF file's blocks, but {source.path!r} is a {source.format} model;"
            " use --quantization int8"
        )


def attach_cpu_kernels(model: LlamaForCausalLM, choice: str, device: torch.device, backend: str) -> None:
    """Steps through the native C kernels (``models.llama_cpu``) on CPU.

    ``auto`` uses them where they build and apply (x86-64 with AVX2 and FMA, a C compiler,
    float32 or bfloat16, the torch attention backend) and otherwise says why in the log;
    ``native`` refuses to start without them; ``torch`` never uses them."""
    model.set_native_path(None)
    if choice == "torch":
        return
    try:
        if device.type != "cpu" or backend != "torch":
            raise NativeKernelsUnavailable(f"they run on CPU with the torch attention backend, not {device}/{backend}")
        if not model.native_cpu and choice == "native":
            raise NativeKernelsUnavailable(f"they compute the Llama layer, not {model.args.architecture}'s")
        if not model.native_cpu:  # layers in torch; decodes' attention still on the paged kernel
            dtype, lib = model.embed_tokens.weight.dtype, load_native_kernels()
            model.layers[0].self_attn.backend.native_decode = PagedDecode(lib, dtype)
            for module in model.modules():  # layers that take a native kernel of their own (Gemma's norms)
                if hasattr(module, "use_native_kernels"):
                    module.use_native_kernels(lib)
            log.info(
                "steps run in torch (the native CPU kernels compute the Llama layer, not %s's); decodes' attention"
                " on the native paged kernel (%s path)",
                model.args.architecture,
                attention_path(),
            )
            return
        model.set_native_path(NativeCpuPath(model, load_native_kernels()))
    except (NativeKernelsUnavailable, ValueError) as exc:
        if choice == "native":
            raise ModelLoadError(f"--cpu-kernels native: {exc}") from exc
        if device.type == "cpu":
            log.info("steps run in torch: native CPU kernels unavailable (%s)", exc)
        return
    log.info(
        "steps run on the native CPU kernels (decodes: paged attention over the block tables at any batch size,"
        " on its %s path; prefill chunks: %s attention; matmuls: %s)",
        attention_path(),
        model.native_path.prefill_path,
        model.native_path.matmul_path(),
    )


def max_model_len(args: LlamaArgs, hf_config: Any, configured: int) -> int:
    """The model's own limit, or less if asked (sliding-window layers attend over their window at any length)."""
    limit = args.max_position_embeddings
    return min(limit, configured) if configured > 0 else limit


def plan_memory(
    loaded: LoadedModel,
    *,
    block_size: int,
    max_len: int,
    kv_cache_memory: int = 0,
    gpu_memory_utilization: float = 0.9,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 128,
    seed: int | None = None,
) -> MemoryFigures:
    """The block count; raises InsufficientMemory when one max-length sequence does not fit (for a model whose
    every layer slides over a window, whose blocks behind it the scheduler frees: one window and one step)."""
    block_bytes = loaded.block_bytes(block_size)
    window = loaded.args.freeing_window
    if window:  # the blocks from the window of a step's first token, and the step's: at most this many tokens
        max_len = min(max_len, window - 1 + max_num_batched_tokens + block_size)
    if loaded.device.type == "cuda":
        figures = _profile_cuda(
            loaded, block_size, block_bytes, gpu_memory_utilization, max_num_batched_tokens, max_num_seqs, seed
        )
        where = "raise --gpu-memory-utilization or lower --max-model-len"
    else:
        mem_total, mem_available = read_meminfo()
        figures = cpu_figures(kv_cache_memory, mem_total, mem_available, loaded.weights_bytes, block_bytes)
        where = "raise --kv-cache-memory or lower --max-model-len"
    check_fits(figures.num_blocks, block_size, max_len, block_bytes, where)
    return figures


def _profile_cuda(loaded, block_size, block_bytes, utilization, num_tokens, num_seqs, seed) -> MemoryFigures:
    """Dummy forward of the largest step, then peak and non-torch usage from the device's own counters.

    Non-torch use is what this process took since it started loading beyond torch's reservations
    (cuBLAS workspaces, kernels), not all memory the device reports used: another process on the
    same GPU (a second worker, a test's stack) holds its own share."""
    device = loaded.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    num_profile_blocks = profile_cache_blocks(num_tokens, num_seqs, block_size)
    runner = create_runner(loaded, block_size, num_profile_blocks, seed)
    runner.profile_run(num_tokens, num_seqs)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - weights
    free, total = torch.cuda.mem_get_info(device)
    used_by_us = (loaded.cuda_free_at_start if loaded.cuda_free_at_start is not None else total) - free
    non_torch = max(used_by_us - torch.cuda.memory_reserved(device), 0)
    del runner
    torch.cuda.empty_cache()
    free_now = torch.cuda.mem_get_info(device)[0]
    return cuda_figures(total, utilization, weights, peak, non_torch, block_bytes, free=free_now)


def cpu_kernels_of(model) -> ctypes.CDLL | None:
    """The native CPU kernels the model's steps run on (its native path's, or, for layers in torch, its decode
    attention's), for the sampler's greedy rows; None where they are not in use."""
    if model.native_path is not None:
        return model.native_path.lib
    layers = getattr(model, "layers", None)
    native_decode = getattr(layers[0].self_attn.backend, "native_decode", None) if layers else None
    return getattr(native_decode, "lib", None)


def create_runner(loaded: LoadedModel, block_size: int, num_blocks: int, seed: int | None = None) -> ModelRunner:
    """Allocates the KV cache and wraps model, cache and sampler."""
    a = loaded.args
    kv_caches = allocate_kv_cache(
        a.num_layers, num_blocks, block_size, a.num_kv_heads, a.head_dim, loaded.dtype, loaded.device
    )
    sampler = Sampler(a.vocab_size, loaded.device, seed, cpu_kernels=cpu_kernels_of(loaded.model))
    runner = ModelRunner(loaded.model, kv_caches, block_size, sampler, loaded.device)
    if hasattr(loaded.model, "encode_images"):
        runner.use_encoder_cache(DEFAULT_CACHE_BYTES)
    return runner
