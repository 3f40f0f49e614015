"""KV-cache sizing arithmetic with fake memory figures, and the refusal to start when nothing fits."""

from __future__ import annotations

import pytest

from services.worker.setup.memory import (
    CPU_DEFAULT_CAP,
    CUDA_FREE_HEADROOM,
    InsufficientMemory,
    bytes_per_block,
    check_fits,
    cpu_figures,
    cpu_kv_cache_bytes,
    cuda_figures,
    read_meminfo,
)

GiB = 2**30


def test_bytes_per_block_smollm2():
    # 2 (K and V) * 30 layers * 16 tokens * 3 KV heads * 64 dims * 2 bytes (bf16)
    assert bytes_per_block(30, 16, 3, 64, 2) == 368_640


def test_cuda_blocks_from_profile():
    block = bytes_per_block(32, 16, 8, 128, 2)  # Llama-3-8B: 2 MiB per block
    assert block == 2 * 2**20
    f = cuda_figures(
        total=80 * GiB, utilization=0.9, weights=16 * GiB, peak_activation=2 * GiB, non_torch=GiB, block_bytes=block
    )
    # floor((80 GiB * 0.9 - 19 GiB) / 2 MiB)
    assert f.num_blocks == int((int(80 * GiB * 0.9) - 19 * GiB) // block)
    assert f.num_blocks == 27136
    assert f.kv_cache_bytes == f.num_blocks * block
    assert (f.method, f.peak_activation_bytes, f.gpu_memory_utilization) == ("cuda-profile", 2 * GiB, 0.9)


def test_cuda_over_budget_gives_zero_blocks():
    f = cuda_figures(total=16 * GiB, utilization=0.5, weights=8 * GiB, peak_activation=GiB, non_torch=0, block_bytes=4)
    assert f.num_blocks == 0 and f.kv_cache_bytes == 0


def test_cpu_configured_and_default_share():
    assert cpu_kv_cache_bytes(configured=123_456, mem_available=64 * GiB) == 123_456
    assert cpu_kv_cache_bytes(configured=0, mem_available=8 * GiB) == 2 * GiB  # 25% of available
    assert cpu_kv_cache_bytes(configured=0, mem_available=64 * GiB) == CPU_DEFAULT_CAP  # capped at 4 GiB
    f = cpu_figures(configured=10_000, mem_total=GiB, mem_available=GiB, weights=500, block_bytes=3_000)
    assert (f.method, f.num_blocks, f.kv_cache_bytes, f.total_bytes, f.weights_bytes) == (
        "cpu-configured",
        3,
        9_000,
        GiB,
        500,
    )


def test_check_fits_accepts_exactly_one_sequence():
    check_fits(num_blocks=64, block_size=16, max_model_len=1024, block_bytes=100, where="x")
    check_fits(num_blocks=64, block_size=16, max_model_len=1017, block_bytes=100, where="x")


def test_refuses_when_one_max_length_sequence_does_not_fit():
    with pytest.raises(InsufficientMemory) as err:
        check_fits(num_blocks=63, block_size=16, max_model_len=1024, block_bytes=1000, where="raise --kv-cache-memory")
    text = str(err.value)
    assert "64 blocks = 64000 bytes" in text and "raise --kv-cache-memory" in text and "\n" not in text


def test_read_meminfo(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       16384 kB\nMemFree:         1024 kB\nMemAvailable:    8192 kB\n")
    assert read_meminfo(str(path)) == (16384 * 1024, 8192 * 1024)


def test_cuda_share_is_this_workers_own_and_capped_by_free_memory():
    """The utilization is per worker: another process's memory is not charged to this one (non_torch
    counts only our own), but the cache never outgrows what is free, less the activations' peak and
    a headroom."""
    block = 2 * 2**20
    kwargs = dict(total=80 * GiB, utilization=0.5, weights=GiB, peak_activation=GiB, non_torch=0, block_bytes=block)
    alone = cuda_figures(**kwargs, free=78 * GiB)
    assert alone.kv_cache_bytes == 38 * GiB  # 40 GiB share - weights - peak
    beside_another = cuda_figures(**kwargs, free=40 * GiB)  # a second worker already holds 39 GiB
    assert beside_another.kv_cache_bytes == 38 * GiB
    crowded = cuda_figures(**kwargs, free=11 * GiB)  # 11 GiB free: 1 for activations, 1 of headroom
    assert crowded.kv_cache_bytes == 11 * GiB - GiB - CUDA_FREE_HEADROOM
    assert cuda_figures(**kwargs, free=GiB + CUDA_FREE_HEADROOM).num_blocks == 0
