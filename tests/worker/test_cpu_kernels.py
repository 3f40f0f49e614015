"""The native CPU decode kernels equal the torch ops they replace, one by one (as a whole model:
test_native_path.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from kvgrid.v1 import common_pb2
from services.worker.attention.base import AttentionMetadata
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.cpu_kernels import library
from services.worker.layers.rope import apply_rotary, cos_sin_tables
from services.worker.sampling.request_sampling import RequestSampling
from services.worker.setup.build import create_runner, load_model
from services.worker.setup.cpu_features import cpu_flags
from tests.worker.tiny import save_tiny_model

DTYPES = {"float32": (torch.float32, 0), "bfloat16": (torch.bfloat16, 1)}
# bf16: the kernels round where torch does, but sum in another order; allow one bf16 step either way.
TOLERANCE = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 8e-3}}


@pytest.fixture(scope="module")
def lib():
    return library.load()


@pytest.fixture(params=sorted(DTYPES))
def dtype(request):
    return DTYPES[request.param]


def randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def two_threads(lib):
    lib.kvg_set_num_threads(2)
    yield
    lib.kvg_set_num_threads(1)


@contextlib.contextmanager
def forced_linear_path(name: str):
    """The bfloat16 GEMV forced to path ``name`` (skipped where this CPU lacks it); the widest restored after."""
    if library.select_linear_path(name) != name:
        library.select_linear_path(library.LINEAR_PATHS[-1])
        pytest.skip(f"this CPU has no {name} GEMV")
    try:
        yield name
    finally:
        library.select_linear_path(library.LINEAR_PATHS[-1])


@pytest.fixture(params=library.LINEAR_PATHS)
def linear_path(lib, request):
    with forced_linear_path(request.param) as name:
        yield name


@pytest.mark.parametrize("rows,n,k", [(1, 64, 64), (3, 37, 45), (8, 200, 136), (2, 9, 600)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear(lib, dtype, linear_path, two_threads, rows, n, k, bias):
    """Row counts short of a group and of a thread's share, and rows whose length ends short of a vector."""
    dt, code = dtype
    x, w = randn(rows, k, dtype=dt, seed=1), randn(n, k, dtype=dt, seed=2)
    b = randn(n, dtype=dt, seed=3) if bias else None
    out = torch.full((rows, n), float("nan"), dtype=dt)
    lib.kvg_linear(x.data_ptr(), w.data_ptr(), b.data_ptr() if bias else None, out.data_ptr(), n, rows, n, k, code, 0)
    torch.testing.assert_close(out, F.linear(x, w, b), **TOLERANCE[dt])


def test_linear_accumulates_into_strided_rows(lib, dtype, linear_path):
    """y += x W^T into every other column: the residual add, rounded as torch rounds it."""
    dt, code = dtype
    x, w = randn(2, 48, dtype=dt, seed=4), randn(16, 48, dtype=dt, seed=5)
    y = randn(2, 32, dtype=dt, seed=6)
    expected = y.clone()
    expected[:, :16] = F.linear(x, w).add_(y[:, :16])
    lib.kvg_linear(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), 32, 2, 16, 48, code, 1)
    torch.testing.assert_close(y, expected, **TOLERANCE[dt])


@pytest.mark.parametrize("rows,width", [(3, 72), (5, 75), (64, 576)])
def test_rms_norm(lib, dtype, two_threads, rows, width):
    """A width with a tail shorter than a vector, and a batch that splits across threads."""
    dt, code = dtype
    x, w = randn(rows, width, dtype=dt, seed=7), randn(width, dtype=dt, seed=8)
    out = torch.empty_like(x)
    lib.kvg_rms_norm(x.data_ptr(), w.data_ptr(), out.data_ptr(), rows, width, 1e-5, code)
    torch.testing.assert_close(out, F.rms_norm(x, (width,), w, 1e-5), **TOLERANCE[dt])


@pytest.mark.parametrize("rows,vocab", [(1, 5), (3, 77), (64, 4099)])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_argmax_rows(lib, two_threads, rows, vocab, dt):
    """torch.argmax of padded rows (bfloat16 ones widened as they are read): the first of tied maxima (in
    one lane, across lanes, in the tail), the first NaN of a row that has any, and -inf rows."""
    padded = randn(rows, vocab + 3, dtype=dt, seed=20)
    padded[:, vocab:] = 1e30  # padding past the vocabulary never wins
    logits = padded[:, :vocab]
    if rows > 1:
        logits[1, [vocab - 1, 2]] = 50.0  # the tie's later index sits in a higher lane
        logits[2].fill_(float("-inf"))
    if rows > 3:
        logits[3, [9, 17, 41, 4000]] = 60.0  # same lane of 8 (and of 32: 41), then the tail
        logits[4, [30, 1000]] = float("nan")
        logits[4, 7] = float("inf")
    out = torch.empty(rows, dtype=torch.int64)
    lib.kvg_argmax_rows(logits.data_ptr(), logits.stride(0), rows, vocab, out.data_ptr(), int(dt == torch.bfloat16))
    assert out.tolist() == logits.float().argmax(dim=-1).tolist()


def test_greedy_sampler_takes_native_argmax(tmp_path, lib):
    """A runner over the native kernels hands them to its sampler; greedy rows of padded logits
    (bf16 upcast, a NaN row) pick what torch.argmax picks. --cpu-kernels torch leaves torch's."""
    path = save_tiny_model(str(tmp_path), "llama")
    native = create_runner(load_model(path, dtype="float32", device="cpu", attention_backend="torch"), 4, 8)
    plain = create_runner(load_model(path, dtype="float32", device="cpu", cpu_kernels="torch"), 4, 8)
    assert native.sampler.cpu_kernels is lib and plain.sampler.cpu_kernels is None
    vocab = native.sampler.vocab_size
    logits = randn(5, vocab + 7, dtype=torch.bfloat16, seed=21)
    logits[:, vocab:] = 100.0
    logits[2, [3, 40]] = float("nan")
    greedy = [RequestSampling.create(common_pb2.SamplingParams(), [], []) for _ in range(5)]
    expected = logits[:, :vocab].float().argmax(-1).tolist()
    assert native.sampler(logits, greedy).token_ids == expected == plain.sampler(logits, greedy).token_ids


@pytest.mark.parametrize("rows,width", [(3, 40), (5, 43), (64, 1536)])
def test_silu_mul(lib, dtype, two_threads, rows, width):
    """Widths with a tail shorter than a vector, and a batch large enough to split across threads;
    gates far out on both sides (exp's clamp)."""
    dt, code = dtype
    gate_up = randn(rows, 2 * width, dtype=dt, seed=9) * 4
    gate_up[0, :4] = torch.tensor([-120.0, -90.0, 90.0, 120.0]).to(dt)
    act = torch.empty(rows, width, dtype=dt)
    lib.kvg_silu_mul(gate_up.data_ptr(), act.data_ptr(), rows, width, code)
    gate, up = gate_up.split(width, dim=-1)
    torch.testing.assert_close(act, F.silu(gate) * up, **TOLERANCE[dt])


def test_silu_mul_lanes_equal_its_tail(lib, dtype):
    """Values in the vector loop (16 lanes with AVX-512, 8 with AVX2) and in the scalar tail (exp8's arithmetic in
    one lane) come out bit for bit alike: a value's activation does not depend on where the row's width puts it."""
    dt, code = dtype
    values = randn(15, dtype=dt, seed=4) * 6
    tail = torch.cat([values, values]).view(1, 30)  # width 15: every value in the tail, past no full vector
    wide = torch.zeros(1, 64, dtype=dt)  # width 32: the values in the vector loop, the ups the same
    wide[0, :15], wide[0, 32:47] = values, values
    narrow_out, wide_out = torch.empty(1, 15, dtype=dt), torch.empty(1, 32, dtype=dt)
    lib.kvg_silu_mul(tail.data_ptr(), narrow_out.data_ptr(), 1, 15, code)
    lib.kvg_silu_mul(wide.data_ptr(), wide_out.data_ptr(), 1, 32, code)
    assert torch.equal(narrow_out[0], wide_out[0, :15])


@pytest.mark.parametrize("rows", [3, 12])
@pytest.mark.parametrize("head_dim", [16, 36])
def test_rope_and_cache_write(lib, dtype, two_threads, rows, head_dim):
    """A few rows, and enough to split across threads; halves of 8 (vectors) and 18 (the scalar loop).
    float32: bitwise Hugging Face's ``x * cos + rotate_half(x) * sin``, each product rounded before the
    add (torch.addcmul, in the torch path, fuses one of them on this CPU)."""
    dt, code = dtype
    heads, kv_heads, block_size = 4, 2, 4
    width = (heads + 2 * kv_heads) * head_dim
    qkv = randn(rows, width, dtype=dt, seed=10)
    cos, sin = cos_sin_tables(head_dim, 10000.0, {}, 64, dt, torch.device("cpu"))
    positions = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:rows]
    slots = torch.randperm(8 * block_size, generator=torch.Generator().manual_seed(2))[:rows]
    k_cache, v_cache = (torch.zeros(8, block_size, kv_heads, head_dim, dtype=dt) for _ in range(2))

    qk = qkv[:, : (heads + kv_heads) * head_dim].view(rows, -1, head_dim)
    expected_qk = apply_rotary(qk, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    qk_before = qk.clone()
    expected_v = qkv[:, (heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim).clone()

    lib.kvg_rope_write_kv(
        qkv.data_ptr(), width, cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), slots.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), rows, heads, kv_heads, head_dim, code,
    )  # fmt: skip
    torch.testing.assert_close(qk, expected_qk, **TOLERANCE[dt])
    if dt == torch.float32:
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        swapped = torch.cat((qk_before[..., head_dim // 2 :], qk_before[..., : head_dim // 2]), -1)  # sin has the sign
        assert torch.equal(qk, qk_before * c + swapped * s)
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    torch.testing.assert_close(flat_k[slots], expected_qk[:, heads:], **TOLERANCE[dt])
    assert torch.equal(flat_v[slots], expected_v)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


def test_exp_within_two_ulp(lib):
    """The softmax's vectorized exp, over the range its arguments take (score - max <= 0) and a little
    past zero, against float64; a tail shorter than a vector goes through the same arithmetic."""
    x = torch.cat([torch.linspace(-87.0, 1.0, 100_003), torch.tensor([0.0, -1e-8, -0.5, -20.0, -86.9])])
    y = torch.empty_like(x)
    lib.kvg_exp(x.data_ptr(), y.data_ptr(), x.numel())
    exact = torch.exp(x.double())
    ulp = (exact.float().nextafter(torch.tensor(float("inf"))) - exact.float()).double()
    assert ((y.double() - exact).abs() / ulp).max() <= 2.0
    assert y[-5] == 1.0


def test_exp16_lanes_equal_exp8(lib):
    """The attention's and SiLU's sixteen-lane exp gives exp8's bits on every argument the softmax and SiLU take,
    the clamp's edges included (2^-126 and 2^127, the powers past which the exponent bits would wrap), so a value
    never depends on the vector width that computed it."""
    x = torch.cat([torch.linspace(-88.0, 89.0, 160_000), torch.tensor([-87.3, -87.29, -87.0, -86.7, 88.3, 0.0] * 16)])
    wide, narrow = torch.empty_like(x), torch.empty_like(x)
    lib.kvg_exp(x.data_ptr(), narrow.data_ptr(), x.numel())
    if not lib.kvg_exp16(x.data_ptr(), wide.data_ptr(), x.numel()):
        pytest.skip("this CPU has no AVX-512")
    assert narrow.min() < 1.3e-38 and narrow.max() > 2e38  # both ends of the clamp are reached
    assert torch.equal(wide, narrow)


def decode_attention_case(lib, dt, code, seq_lens, heads, kv_heads, head_dim, query_scale=1.0, block_size=4, window=0):
    """The kernel's output and the torch backend's for one query token per sequence over scattered blocks."""
    g = torch.Generator().manual_seed(11)
    width = -(-max(seq_lens) // block_size)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dt)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dt)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(seq_lens):  # scattered blocks, padded rows
        count = -(-n // block_size)
        tables[i, :count] = perm[used : used + count].int()
        used += count
    query = (torch.randn(len(seq_lens), heads, head_dim, generator=g) * query_scale).to(dt)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.zeros(len(seq_lens), dtype=torch.int64),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_lens_cpu=[1] * len(seq_lens),
        seq_lens_cpu=seq_lens,
    )
    scale = head_dim**-0.5
    if window:  # the blocks wholly before each window may hold anything: they must never be read
        for i, n in enumerate(seq_lens):
            for block in tables[i, : max(n - window, 0) // block_size].tolist():
                k_cache[block], v_cache[block] = float("nan"), float("nan")
    expected = TorchAttentionBackend().forward(query, k_cache, v_cache, meta, scale, window)
    out = torch.empty_like(query)
    lib.kvg_decode_attention(
        query.data_ptr(), heads * head_dim, k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), width,
        meta.seq_lens.data_ptr(), out.data_ptr(), heads * head_dim, len(seq_lens), heads, kv_heads, head_dim,
        block_size, scale, code, window,
    )  # fmt: skip
    return out, expected


@pytest.fixture(params=library.ATTENTION_PATHS)
def attention_path(lib, request):
    """Each vector width of paged decode attention this CPU has (AVX-512: head sizes 64 and 128; AVX512-BF16:
    those in bfloat16, float32 takes the AVX-512 path there)."""
    if library.select_attention_path(request.param) != request.param:
        library.select_attention_path(library.ATTENTION_PATHS[-1])
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    library.select_attention_path(library.ATTENTION_PATHS[-1])


def test_attention_path_is_the_widest_the_cpu_has(lib):
    flags = cpu_flags()
    widest = "avx2"
    if "avx512f" in flags:
        widest = "avx512-bf16" if {"avx512_bf16", "avx512bw"} <= flags else "avx512"
    assert library.select_attention_path("avx512-bf16") == widest
    assert library.select_attention_path("avx2") == "avx2"
    assert library.select_attention_path("avx512") == min(widest, "avx512", key=library.ATTENTION_PATHS.index)
    assert library.select_attention_path("avx512-bf16") == widest
    assert library.attention_path() == widest


def test_linear_path_is_the_widest_the_cpu_has(lib):
    widest = "avx512-bf16" if {"avx512_bf16", "avx512bw"} <= cpu_flags() else "avx2"
    assert library.select_linear_path("avx2") == "avx2"
    assert library.select_linear_path("avx512-bf16") == widest
    assert library.linear_path() == widest


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(9, 3, 64), (16, 1, 16), (4, 4, 40), (40, 2, 36), (8, 2, 128), (12, 12, 64)]
)
def test_decode_attention_equals_torch_backend(lib, dtype, attention_path, heads, kv_heads, head_dim):
    """Sequences shorter than one 128-token chunk of the kernel and one split over three, in one batch;
    a head size that is no multiple of 8, 20 query heads per KV head, and the head sizes AVX-512 takes
    (in bfloat16 on AVX512-BF16 CPUs: dot products of bfloat16 pairs)."""
    dt, code = dtype
    out, expected = decode_attention_case(lib, dt, code, [1, 5, 300, 16, 33], heads, kv_heads, head_dim)
    torch.testing.assert_close(out, expected, **TOLERANCE[dt])


@pytest.mark.parametrize("window", [1, 7, 64, 200])
def test_decode_attention_reads_only_the_sliding_window(lib, dtype, attention_path, window):
    """A sliding-window layer: each sequence's last ``window`` tokens, from any offset in a block and any chunk;
    the blocks wholly before the window hold NaN (freed, perhaps another request's by now) and must not be read."""
    dt, code = dtype
    seq_lens = [1, 5, 300, 16, 33, 129]
    out, expected = decode_attention_case(lib, dt, code, seq_lens, 9, 3, 64, block_size=4, window=window)
    assert not expected.isnan().any()
    torch.testing.assert_close(out, expected, **TOLERANCE[dt])


@pytest.mark.parametrize("seq_lens", [[37], [1000], [200, 3], [9, 130, 1, 64]])
def test_decode_attention_splits_short_batches_across_threads(lib, dtype, attention_path, seq_lens):
    """With more threads than a few sequences' 128-token chunks, contexts split into chunks of 32 and up;
    scores spread wide (a sharp softmax) take the vectorized exp far from zero."""
    dt, code = dtype
    lib.kvg_set_num_threads(4)
    try:
        out, expected = decode_attention_case(lib, dt, code, seq_lens, 9, 3, 64, query_scale=6.0, block_size=16)
    finally:
        lib.kvg_set_num_threads(1)
    torch.testing.assert_close(out, expected, **TOLERANCE[dt])


def test_build_is_cached_per_source(tmp_path, monkeypatch):
    first = library.build(tmp_path)
    assert first.parent == tmp_path and first.stat().st_size > 0
    monkeypatch.setenv("CC", "false")  # a second build would fail: the cached library is reused
    assert library.build(tmp_path) == first
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left behind
