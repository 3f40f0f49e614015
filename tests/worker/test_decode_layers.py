"""A decode step's layers in one native call (``kvg_decode_layers``) compute what the per-op loop computes, bit for
bit: the same kernels in the same order, for float weights on the GEMV (both bfloat16 GEMV paths) or AMX tiles,
packed int8 and GGUF weights, and sliding-window layers; one-row steps on weights the quantized kernel splits by
tiles run as one OpenMP team, with the same outputs; GGUF batches take the quantized kernel or the AMX tile GEMM on
the weights' bfloat16 copies; steps with a product only Python calls (a GEMM) keep the loop."""

from __future__ import annotations

import pytest
import torch

from services.worker.cpu_kernels import library, tile_gemm
from services.worker.models import llama_one_call
from services.worker.quant import matmul
from services.worker.quant.formats import PackedParts
from services.worker.setup.build import create_runner, load_model
from tests.worker.test_cpu_kernels import forced_linear_path
from tests.worker.tiny import drop_packed_gemms, request, run_logits, save_tiny_model
from tests.worker.tiny_gguf import VOCAB, write_gguf


def q4_k_down_q8_0_rest(name: str) -> str:
    return "q4_k" if name.endswith(".ffn_down.weight") else "q8_0"


def float_model(tmp_path, dtype: str, kind: str = "llama", **overrides):
    loaded = load_model(save_tiny_model(str(tmp_path), kind, **overrides), dtype=dtype, device="cpu")
    drop_packed_gemms(loaded.model)  # the GEMV up to its rows
    return loaded


def q4_1_attention_q8_0_rest(name: str) -> str:
    return "q4_1" if ".attn_" in name else "q8_0"


def gguf_model(tmp_path, choose=q4_k_down_q8_0_rest, dtype="float32"):
    model_dir = str(tmp_path / "hf")
    save_tiny_model(model_dir, "llama", seed=3, vocab_size=VOCAB, intermediate_size=256)
    path = str(tmp_path / "tiny.gguf")
    write_gguf(model_dir, path, choose)
    return load_model(path, dtype=dtype, device="cpu", quantization="gguf")


@pytest.fixture
def two_threads():
    """The team runs where a step has threads to split it (num_threads > 1), whatever this machine has."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def decode_logits(loaded, num_requests: int, one_call: bool, steps: int = 4) -> list[torch.Tensor]:
    """Logits of ``steps`` decode steps after a prefill, the layers in one call or op by op (same seeds)."""
    native = loaded.model.native_path
    assert native is not None
    num_blocks = 16 * num_requests
    runner = create_runner(loaded, block_size=4, num_blocks=num_blocks)
    g = torch.Generator().manual_seed(5)
    vocab = loaded.args.vocab_size
    prompts = [torch.randint(0, vocab, (5 + 4 * i,), generator=g).tolist() for i in range(num_requests)]
    requests = [
        request(f"r{i}", p, list(range(i, num_blocks, num_requests)), 0, len(p)) for i, p in enumerate(prompts)
    ]  # interleaved blocks
    run_logits(runner, requests)
    native._in_one_call[num_requests] = one_call and llama_one_call.all_native(
        native.model.layers, native.rows.takes_gemv, num_requests
    )
    logits = []
    for _ in range(steps):
        for r in requests:
            r.token_ids.append(int(torch.randint(0, vocab, (1,), generator=g)))
            r.num_scheduled_tokens = 1
        with torch.inference_mode():
            logits.append(runner.compute_logits(runner.prepare(requests)))
        for r in requests:
            r.num_computed_tokens += 1
            r.num_scheduled_tokens = 0
    return logits


def assert_one_call_equals_loop(make_model, num_requests: int, team: bool = False) -> None:
    loaded = make_model()
    assert loaded.model.native_path.in_one_call(num_requests)
    ours = decode_logits(loaded, num_requests, one_call=True)
    program = loaded.model.native_path._program
    assert program is not None  # the one call was taken
    assert program[1].team == team
    loop = decode_logits(make_model(), num_requests, one_call=False)
    for a, b in zip(ours, loop, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("num_requests", [1, 3])
def test_float32(tmp_path, num_requests):
    assert_one_call_equals_loop(lambda: float_model(tmp_path, "float32"), num_requests)


@pytest.mark.parametrize("path", library.LINEAR_PATHS)
@pytest.mark.parametrize("num_requests", [1, 4])
def test_bfloat16_on_each_gemv_path(tmp_path, path, num_requests):
    with forced_linear_path(path):
        assert_one_call_equals_loop(lambda: float_model(tmp_path, "bfloat16"), num_requests)


@pytest.mark.skipif(not tile_gemm.available(), reason="no tile kernel here (AMX-BF16 or AVX512-BF16)")
def test_bfloat16_on_amx_tiles(tmp_path):
    """Above the GEMV's rows the layers' products take the AMX tile GEMM, from C as from Python (6 rows, padded to a
    block of 16)."""

    def tiled_model():
        loaded = load_model(save_tiny_model(str(tmp_path), "llama"), dtype="bfloat16", device="cpu")
        assert isinstance(loaded.model.layers[0].mlp.down_proj.gemm, tile_gemm.TileGemm)
        return loaded

    assert_one_call_equals_loop(tiled_model, 6)


def test_sliding_window_layers(tmp_path):
    """Mistral's window of 8 under prompts of 5 to 13 tokens and 4 more: the one call passes each layer's window."""
    make = lambda: float_model(tmp_path, "float32", "mistral", sliding_window=8)  # noqa: E731
    assert make().model.layers[0].self_attn.window == 8
    assert_one_call_equals_loop(make, 3)


def test_int8_batch_one_as_a_team(tmp_path, monkeypatch, two_threads):
    monkeypatch.setattr(matmul, "INT8_GEMM_ROWS", None)  # the native kernel on the tiled layout
    path = save_tiny_model(str(tmp_path), "llama")
    assert_one_call_equals_loop(lambda: load_model(path, dtype="float32", device="cpu", quantization="int8"), 1, True)


def test_gguf_q4_1_and_q8_0_batch_one_as_a_team(tmp_path, two_threads):
    """Q4_1 attention and Q8_0 MLP blocks, each thread a share of every product's tiles."""
    assert_one_call_equals_loop(lambda: gguf_model(tmp_path, q4_1_attention_q8_0_rest), 1, team=True)


def test_gguf_k_quants_batch_one(tmp_path, two_threads):
    """Q8_0 and Q4_K blocks (the K-quants split their own way: no team) through the quantized kernel, called
    from the native loop by its address."""
    assert_one_call_equals_loop(lambda: gguf_model(tmp_path), 1)


@pytest.mark.skipif(
    matmul.AMX_ROWS is None or not tile_gemm.available(), reason="no tile kernel here (AMX-BF16 or AVX512-BF16)"
)
@pytest.mark.parametrize("num_requests", [3, 9])
def test_gguf_batches_in_bfloat16(tmp_path, num_requests):
    """Steps of several rows on GGUF weights in one call: below AMX_ROWS the quantized kernel on every row, from
    it the AMX tile GEMM on the weights' bfloat16 copies (9 rows, padded to a block of 16)."""

    def copied_model():
        loaded = gguf_model(tmp_path, q4_1_attention_q8_0_rest, dtype="bfloat16")
        assert all(m.packed.amx is not None for m in llama_one_call.products(loaded.model.layers[0]))
        return loaded

    assert_one_call_equals_loop(copied_model, num_requests, team=True)  # (a team at one row only: these loop in C)


def test_steps_with_a_gemm_keep_the_loop(tmp_path, monkeypatch):
    """Weights packed for a GEMM take it from 2 rows in float32, int8 weights the int8 GEMM from its rows: only Python
    calls them."""
    loaded = load_model(save_tiny_model(str(tmp_path), "llama"), dtype="float32", device="cpu")
    native = loaded.model.native_path
    assert loaded.model.logits_gemm is not None
    assert native.in_one_call(1) and not native.in_one_call(2)
    monkeypatch.setattr(matmul, "INT8_GEMM_ROWS", 2)  # both layouts kept: the native kernel's at one row
    packed = load_model(str(tmp_path), dtype="float32", device="cpu", quantization="int8").model.native_path
    assert packed.in_one_call(1) and not packed.in_one_call(2)


def q4_1_query_q8_0_rest(name: str) -> str:
    return "q4_1" if ".attn_q." in name else "q8_0"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gguf_parts_take_a_long_prefill(tmp_path, dtype):
    """A fused q/k/v stored in two types stays packed as parts, which keep no AMX copy of their own: a prefill chunk of
    more rows than DEQUANTIZE_ROWS multiplies each part on its own (and the step after decodes)."""
    loaded = gguf_model(tmp_path, q4_1_query_q8_0_rest, dtype=dtype)
    qkv = loaded.model.layers[0].self_attn.qkv_proj.packed
    assert isinstance(qkv, PackedParts) and qkv.amx is None
    runner = create_runner(loaded, block_size=4, num_blocks=40)
    prompt = torch.randint(0, VOCAB, (matmul.DEQUANTIZE_ROWS + 20,), generator=torch.Generator().manual_seed(7))
    r = request("long", prompt.tolist(), list(range(40)), 0, len(prompt))
    logits = run_logits(runner, [r])["long"]
    assert logits.shape == (loaded.args.vocab_size,) and torch.isfinite(logits.float()).all()
    r.token_ids.append(int(logits.argmax()))
    r.num_scheduled_tokens = 1
    assert torch.isfinite(run_logits(runner, [r])["long"].float()).all()
