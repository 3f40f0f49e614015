"""How many KV blocks fit: pure arithmetic over memory figures (tests feed fake ones).

CUDA: ``num_blocks = floor((total * utilization - used_after_profile) / bytes_per_block)``
where ``used_after_profile`` is this worker's own use: the weights, the peak activations of a dummy
forward pass of ``max_num_batched_tokens`` tokens, and what it holds outside torch's allocator.
The utilization is this worker's share of the device (as in vLLM): memory other processes hold
is not charged to it, but the cache never takes more than is free after profiling, less the
activations' peak that every step will need again and ``CUDA_FREE_HEADROOM``.
CPU: ``--kv-cache-memory`` bytes, or a safe share of the available RAM.
"""

from __future__ import annotations

from dataclasses import dataclass

CPU_DEFAULT_SHARE = 0.25
CPU_DEFAULT_CAP = 4 * 2**30
# Left free on the device when the cache is capped by free memory: cuBLAS workspaces, CUDA-graph
# pools and the sampler's temporaries come after the profile (seen on an H100: a cache that took all
# but the activations' peak failed its first cuBLAS call).
CUDA_FREE_HEADROOM = 2**30


class InsufficientMemory(Exception):
    """Not even one maximum-length sequence fits; the message says how much memory it needs."""


@dataclass(slots=True)
class MemoryFigures:
    """The numbers behind the block count (mirrors the Handshake's MemoryProfile)."""

    method: str  # "cuda-profile" or "cpu-configured"
    total_bytes: int
    weights_bytes: int
    peak_activation_bytes: int
    non_torch_bytes: int
    kv_cache_bytes: int
    gpu_memory_utilization: float
    num_blocks: int


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Keys and values of one block across all layers."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes


def cuda_kv_cache_bytes(
    total: int, utilization: float, weights: int, peak_activation: int, non_torch: int, free: int | None = None
) -> int:
    """What is left for the KV cache of this worker's share after its profiled usage, capped by what is
    ``free`` on the device after profiling less the activations' peak and a headroom (may be negative)."""
    budget = int(total * utilization) - (weights + peak_activation + non_torch)
    return budget if free is None else min(budget, free - peak_activation - CUDA_FREE_HEADROOM)


def cpu_kv_cache_bytes(configured: int, mem_available: int) -> int:
    """``--kv-cache-memory`` when set, else min(25% of available RAM, 4 GiB)."""
    if configured > 0:
        return configured
    return min(int(mem_available * CPU_DEFAULT_SHARE), CPU_DEFAULT_CAP)


def num_blocks_for(kv_cache_bytes: int, block_bytes: int) -> int:
    return max(kv_cache_bytes, 0) // block_bytes


def check_fits(num_blocks: int, block_size: int, max_model_len: int, block_bytes: int, where: str) -> None:
    """Raises InsufficientMemory unless one sequence of max_model_len tokens fits in the cache."""
    needed_blocks = -(-max_model_len // block_size)
    if num_blocks >= needed_blocks:
        return
    raise InsufficientMemory(
        f"the KV cache has room for {num_blocks} blocks ({num_blocks * block_size} tokens) but one sequence of "
        f"--max-model-len {max_model_len} tokens needs {needed_blocks} blocks = {needed_blocks * block_bytes} bytes "
        f"({needed_blocks * block_bytes / 2**20:.1f} MiB); {where}"
    )


def cpu_figures(configured: int, mem_total: int, mem_available: int, weights: int, block_bytes: int) -> MemoryFigures:
    kv_bytes = cpu_kv_cache_bytes(configured, mem_available)
    num_blocks = num_blocks_for(kv_bytes, block_bytes)
    return MemoryFigures("cpu-configured", mem_total, weights, 0, 0, num_blocks * block_bytes, 0.0, num_blocks)


def cuda_figures(
    total: int,
    utilization: float,
    weights: int,
    peak_activation: int,
    non_torch: int,
    block_bytes: int,
    free: int | None = None,
) -> MemoryFigures:
    kv_bytes = cuda_kv_cache_bytes(total, utilization, weights, peak_activation, non_torch, free)
    num_blocks = num_blocks_for(kv_bytes, block_bytes)
    return MemoryFigures(
        "cuda-profile", total, weights, peak_activation, non_torch, num_blocks * block_bytes, utilization, num_blocks
    )


def read_meminfo(path: str = "/proc/meminfo") -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes."""
    values = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            values[key] = int(rest.split()[0]) * 1024
    return values["MemTotal"], values.get("MemAvailable", values.get("MemFree", 0))
