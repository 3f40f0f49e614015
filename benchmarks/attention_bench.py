"""Paged attention on CUDA: Triton kernel vs. the torch backend, as memory bandwidth.

    python -m benchmarks.attention_bench [--batch 64] [--context 2048] [--shape llama-8b] [--json OUT]

Decode attention is bound by reading the KV cache, so the figure of merit is achieved bandwidth
(bytes of K, V, queries, outputs and block tables per second) as a fraction of the GPU's peak:
the nominal datasheet figure where the GPU is known, and always a measured device-to-device copy.
A second scenario mixes prefill chunks with decodes in one step; a third is a small batch over a
long context, where split-KV (flash decoding, ``num_splits``) should pay off if it ever does.
Decode scenarios also time PyTorch's fused SDPA over the same K/V stored contiguously.
Writes JSON to ``benchmarks/results/attention_bench.json`` (or ``--json``). Without CUDA it says so
and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass

import torch

from benchmarks.results import save

# (num_heads, num_kv_heads, head_dim)
SHAPES = {"llama-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64), "llama-70b-tp8": (8, 1, 128)}
# Nominal HBM bandwidth in bytes/s by device-name substring, most specific first.
NOMINAL_BANDWIDTH = [
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100-PCIE-40GB", 1.555e12),
    ("A100-SXM4-40GB", 1.555e12),
    ("A100", 2.039e12),
    ("L40S", 0.864e12),
    ("L4", 0.3e12),
    ("A10G", 0.6e12),
    ("RTX 4090", 1.008e12),
]


@dataclass(slots=True)
class Result:
    scenario: str
    impl: str
    ms: float
    gb_per_s: float
    fraction_of_nominal: float | None
    fraction_of_copy: float


def nominal_bandwidth(name: str) -> float | None:
    return next((bw for key, bw in NOMINAL_BANDWIDTH if key in name), None)


def copy_bandwidth(do_bench) -> float:
    """Device-to-device copy of 1 GiB: read + write bytes per second, the practical ceiling."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def build_step(lens: list[tuple[int, int]], shape: tuple[int, int, int], block_size: int, dtype, device="cuda"):
    """Query, caches and metadata for (q_len, seq_len) requests with shuffled blocks."""
    from services.worker.attention import AttentionMetadata

    num_heads, num_kv_heads, head_dim = shape
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in lens]
    num_blocks = sum(blocks_per_seq)
    perm = torch.randperm(num_blocks).tolist()
    table = torch.zeros(len(lens), max(blocks_per_seq), dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    q_lens = [q for q, _ in lens]
    seq_lens = [s for _, s in lens]
    query_start_loc = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table.to(device),
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64, device=device),  # unused by forward
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
    )
    query = torch.randn(sum(q_lens), num_heads, head_dim, dtype=dtype, device=device)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    return query, k_cache, v_cache, meta


def step_bytes(query: torch.Tensor, k_cache: torch.Tensor, meta) -> int:
    """Bytes an ideal kernel moves: each request's K and V once, queries in, outputs out, tables."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    kv = 2 * sum(meta.seq_lens_cpu) * num_kv_heads * head_dim * k_cache.element_size()
    return kv + 2 * query.numel() * query.element_size() + meta.block_tables.numel() * 4


def sdpa_baseline(query, k_cache, v_cache, meta, scale):
    """PyTorch's fused SDPA over the same K/V laid out contiguously per request (what a server without
    paging holds), for decode steps of equal lengths; the gather into that layout is not timed."""
    q_lens, seq_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    if set(q_lens) != {1} or len(set(seq_lens)) != 1:
        return None
    batch, ctx = len(seq_lens), seq_lens[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    blocks = meta.block_tables[:, : -(-ctx // block_size)].long()

    def contiguous(cache):  # [B, KVH, ctx, D]
        return cache[blocks].reshape(batch, -1, num_kv_heads, head_dim)[:, :ctx].transpose(1, 2).contiguous()

    k, v = contiguous(k_cache), contiguous(v_cache)
    q = query.view(batch, 1, -1, head_dim).transpose(1, 2)  # [B, H, 1, D]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def call():
        return sdpa(q, k, v, scale=scale, enable_gqa=True).transpose(1, 2).reshape(query.shape)

    return call


def run_scenario(name, lens, args, dtype, do_bench, nominal, copy_bw, device="cuda") -> list[Result]:
    from kernels.paged_attention import paged_attention
    from services.worker.attention.torch_backend import TorchAttentionBackend

    query, k_cache, v_cache, meta = build_step(lens, SHAPES[args.shape], args.block_size, dtype, device)
    scale = query.shape[-1] ** -0.5
    torch_backend = TorchAttentionBackend()
    expected = torch_backend.forward(query, k_cache, v_cache, meta, scale)
    num_bytes = step_bytes(query, k_cache, meta)
    impls = {"torch": lambda: torch_backend.forward(query, k_cache, v_cache, meta, scale)}
    for tile_n in args.tile_n:
        for num_splits in args.num_splits:
            out = torch.empty_like(query)

            def triton_call(tile_n=tile_n, num_splits=num_splits, out=out):
                return paged_attention(
                    query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
                    meta.max_query_len, out=out, tile_n=tile_n, num_splits=num_splits,
                )  # fmt: skip

            torch.testing.assert_close(triton_call(), expected, atol=2e-2, rtol=2e-2)
            impls[f"triton n={tile_n} splits={num_splits}"] = triton_call
    sdpa = sdpa_baseline(query, k_cache, v_cache, meta, scale)
    if sdpa is not None:
        torch.testing.assert_close(sdpa(), expected, atol=2e-2, rtol=2e-2)
        impls["torch SDPA (contiguous KV)"] = sdpa
    results = []
    for impl, fn in impls.items():
        ms = do_bench(fn)
        bw = num_bytes / (ms * 1e-3)
        results.append(Result(name, impl, ms, bw / 1e9, bw / nominal if nominal else None, bw / copy_bw))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="decode requests")
    parser.add_argument("--context", type=int, default=2048, help="tokens in context per decode request")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--tile-n", type=int, nargs="+", default=[32, 64], help="keys per kernel iteration")
    parser.add_argument("--num-splits", type=int, nargs="+", default=[1, 4], help="split-KV ranges")
    parser.add_argument("--long-context", type=int, default=16384, help="context of the small-batch scenario")
    parser.add_argument("--json", default="", help="write the JSON here (default: benchmarks/results/)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_bench needs a CUDA GPU (the Triton kernels run natively only there); skipping.")
        return 0
    from triton.testing import do_bench

    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name()
    nominal = nominal_bandwidth(name)
    copy_bw = copy_bandwidth(do_bench)
    nominal_text = f"{nominal / 1e9:.0f} GB/s" if nominal else "unknown"
    print(f"{name}: nominal {nominal_text}, measured copy {copy_bw / 1e9:.0f} GB/s")
    print(f"shape {args.shape} {SHAPES[args.shape]} (heads, kv heads, head dim), {args.dtype}, block {args.block_size}")
    decode = [(1, args.context)] * args.batch
    mixed = [(1, args.context)] * (args.batch - 4) + [(512, args.context)] * 4  # 4 prefill chunks over a cache
    long = [(1, args.long_context)] * 2
    scenarios = [
        (f"decode b={args.batch} ctx={args.context}", decode),
        ("mixed 4x512 prefill", mixed),
        (f"decode b=2 ctx={args.long_context}", long),
    ]
    results = []
    for scenario, lens in scenarios:
        results += run_scenario(scenario, lens, args, dtype, do_bench, nominal, copy_bw)
    print(f"{'scenario':32} {'impl':26} {'ms':>8} {'GB/s':>8} {'of peak':>8} {'of copy':>8}")
    for r in results:
        of_peak = f"{r.fraction_of_nominal:8.1%}" if r.fraction_of_nominal is not None else f"{'-':>8}"
        print(f"{r.scenario:32} {r.impl:26} {r.ms:8.3f} {r.gb_per_s:8.0f} {of_peak} {r.fraction_of_copy:8.1%}")
    save("attention_bench", {"device": name, "args": vars(args), "results": [asdict(r) for r in results]}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
