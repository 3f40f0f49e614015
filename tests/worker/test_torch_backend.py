"""The torch attention backend over a paged cache equals a contiguous reference on random block tables."""

from __future__ import annotations

import pytest
import torch

from services.worker.attention import AttentionMetadata, get_backend


def reference_attention(q, k, v, scale):
    """q: [q_len, H, D]; k, v: [seq_len, KV, D] contiguous; the queries are the last q_len positions."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    allowed = torch.arange(seq_len)[None, :] <= torch.arange(q_len)[:, None] + (seq_len - q_len)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def build_batch(spec, num_heads, num_kv_heads, head_dim, block_size, num_blocks, dtype, seed):
    """spec: [(cached, new)] per request. Returns query, caches with the cached prefixes written,
    new k/v, metadata, and the contiguous k/v of every request."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, full_k, full_v, queries, new_k, new_v = [], [], [], [], [], [], []
    for cached, new in spec:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // block_size))]
        k = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
        for p in range(cached):  # the prefix is already in the cache
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, total)]
        tables.append(table)
        full_k.append(k)
        full_v.append(v)
        new_k.append(k[cached:])
        new_v.append(v[cached:])
        queries.append(torch.randn(new, num_heads, head_dim, generator=g).to(dtype))
    width = max(len(t) for t in tables)
    q_lens, seq_lens = [n for _, n in spec], [c + n for c, n in spec]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
    )
    return torch.cat(queries), k_cache, v_cache, torch.cat(new_k), torch.cat(new_v), meta, full_k, full_v


SPECS = {
    "decode-only": [(5, 1), (0, 1), (40, 1), (16, 1), (17, 1)],
    "prefill-only": [(0, 9), (0, 33), (0, 1)],
    "mixed-decodes-first": [(12, 1), (3, 1), (0, 20), (7, 5), (30, 1)],
    "chunked-prefix": [(24, 8), (1, 15)],
}


@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 16), (9, 3, 64), (8, 1, 32)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_equals_contiguous(spec_name, num_heads, num_kv_heads, head_dim, block_size, dtype):
    spec = SPECS[spec_name]
    query, k_cache, v_cache, new_k, new_v, meta, full_k, full_v = build_batch(
        spec, num_heads, num_kv_heads, head_dim, block_size, 200, dtype, seed=block_size + num_heads
    )
    backend = get_backend("torch", "cpu")
    backend.write_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    scale = head_dim**-0.5
    out = backend.forward(query, k_cache, v_cache, meta, scale)
    assert out.shape == query.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    starts = meta.query_start_loc.tolist()
    for i in range(len(spec)):
        expected = reference_attention(query[starts[i] : starts[i + 1]], full_k[i], full_v[i], scale)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]].double(), expected, atol=tol, rtol=tol)


def test_write_kv_puts_each_token_in_its_slot():
    backend = get_backend("torch", "cpu")
    k_cache = torch.zeros(6, 4, 2, 8)
    v_cache = torch.zeros(6, 4, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    backend.write_kv(key, value, k_cache, v_cache, torch.tensor([21, 2, 7]))
    torch.testing.assert_close(k_cache[5, 1], key[0])
    torch.testing.assert_close(v_cache[0, 2], value[1])
    torch.testing.assert_close(k_cache[1, 3], key[2])
    assert torch.count_nonzero(k_cache) == key.numel() and torch.count_nonzero(v_cache) == value.numel()
