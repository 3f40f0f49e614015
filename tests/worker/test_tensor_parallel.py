"""Tensor-parallel sharding without processes: two ranks as two threads of this process, their
all-reduce a barrier, rank 0 feeding rank 1 each step over a pipe (the real ranks get it over ``parallel.control``).

The sharded model's logits equal the unsharded model's over prefill, mixed and decode steps; the
shards have the shapes the heads and MLP width divide into; sizes that do not divide are refused.
The real processes (gloo, a killed rank) are tested end to end in tests/e2e/test_tensor_parallel.py.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
from collections.abc import Iterator

import pytest
import torch

from services.common.config import build_config
from services.worker.model_runner import ModelRunner
from services.worker.models.llama import LlamaArgs
from services.worker.parallel.follower import pack_step, serve_steps
from services.worker.parallel.plan import check_options, plan_rank, rank_device
from services.worker.parallel.sharding import attach_all_reduce, check_size, divisible_sizes, shard_weights
from services.worker.setup.build import create_runner, load_model
from services.worker.setup.loader import ModelLoadError
from tests.worker.test_cli_errors import _one_error_line, _run_worker
from tests.worker.tiny import request, run_logits, save_tiny_model

BLOCK_SIZE = 4
NUM_BLOCKS = 64


class ThreadGroup:
    """``size`` ranks as threads: each all-reduce waits for all of them and sums in rank order."""

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size, timeout=30)
        self.parts: list[torch.Tensor | None] = [None] * size

    def all_reduce_of(self, rank: int):
        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = x.clone()
            self.barrier.wait()
            total = sum(self.parts[1:], self.parts[0].clone())
            self.barrier.wait()  # nobody overwrites a part before every rank has summed
            return x.copy_(total)

        return all_reduce


def load(path: str, rank: int = 0, size: int = 1, quantization: str = "none"):
    loaded = load_model(
        path, dtype="float32", device="cpu", cpu_kernels="torch", quantization=quantization, tp_rank=rank, tp_size=size
    )
    return loaded, create_runner(loaded, BLOCK_SIZE, NUM_BLOCKS)


@contextlib.contextmanager
def two_ranks(path: str, quantization: str = "none") -> Iterator[ModelRunner]:
    """Rank 0's runner; rank 1 runs in a thread, fed each step over a pipe until the block ends."""
    group = ThreadGroup(2)
    shards = [load(path, rank, 2, quantization) for rank in range(2)]
    for rank, (loaded, _) in enumerate(shards):
        attach_all_reduce(loaded.model, group.all_reduce_of(rank))
    rank0, rank1 = shards[0][1], shards[1][1]
    receive, send = multiprocessing.Pipe(duplex=False)
    rank0.step_listener = lambda inputs: send.send(pack_step(inputs))
    follower = threading.Thread(target=serve_steps, args=(receive, rank1), daemon=True)
    follower.start()
    try:
        yield rank0
    finally:
        send.send(None)
        follower.join(10)
    assert not follower.is_alive()


@pytest.fixture(
    scope="module",
    params=[("llama", {"attention_bias": True, "mlp_bias": True}), ("qwen2", {})],
    ids=["llama-biases", "qwen2"],
)
def model_dir(request, tmp_path_factory) -> str:
    kind, overrides = request.param
    return save_tiny_model(str(tmp_path_factory.mktemp(kind)), kind, **overrides)


def steps() -> list[list]:
    """Three steps over the same requests: two prompts (one chunked), then a mixed step, then decodes."""
    a = request("a", list(range(3, 14)), [9, 4, 17, 21], 0, 11)
    b = request("b", list(range(40, 49)), [2, 30, 5], 0, 5)
    return [[a, b], [a, b], [a, b]]


def test_two_ranks_give_the_logits_of_one(model_dir):
    _, full = load(model_dir)
    with two_ranks(model_dir) as rank0:
        reference, sharded = steps(), steps()
        for step_ref, step_tp in zip(reference, sharded, strict=True):
            want, got = run_logits(full, step_ref), run_logits(rank0, step_tp)
            assert want.keys() == got.keys()
            for rid, logits in want.items():
                torch.testing.assert_close(got[rid], logits, rtol=1e-4, atol=1e-5)
            for ref, tp in zip(step_ref, step_tp, strict=True):  # the next step: one more token (decode)
                token = int(want[ref.request_id].argmax()) if ref.request_id in want else None
                for r in (ref, tp):
                    if token is not None:
                        r.token_ids.append(token)
                    r.num_scheduled_tokens = len(r.token_ids) - r.num_computed_tokens


def test_int8_shards_are_as_close_to_float_as_unsharded_int8(model_dir):
    """Row-parallel shards take one scale per output channel of their own columns: not the unsharded
    int8 numbers, but no further from the float model than they are."""
    _, full = load(model_dir)
    _, int8 = load(model_dir, quantization="int8")
    want = run_logits(full, steps()[0])
    error = {rid: (run_logits(int8, steps()[0])[rid] - logits).abs().max() for rid, logits in want.items()}
    with two_ranks(model_dir, "int8") as rank0:
        got = run_logits(rank0, steps()[0])
    for rid, logits in want.items():
        sharded_error = (got[rid] - logits).abs().max()
        assert 0 < sharded_error <= 3 * error[rid], (rid, sharded_error, error[rid])


def test_shards_hold_their_share_of_heads_and_columns(model_dir):
    full, _ = load(model_dir)
    (shard, runner) = load(model_dir, 1, 2)
    a = full.args  # 4 query heads, 2 KV heads, head_dim 16, hidden 64, MLP 96
    assert (shard.args.num_heads, shard.args.num_kv_heads, shard.args.intermediate_size) == (2, 1, 48)
    attn, full_attn = shard.model.layers[0].self_attn, full.model.layers[0].self_attn
    assert attn.qkv_proj.weight.shape == ((2 + 2 * 1) * 16, 64)
    assert attn.o_proj.weight.shape == (64, 2 * 16)
    assert shard.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 48, 64)
    assert shard.model.layers[0].mlp.down_proj.weight.shape == (64, 48)
    assert runner.kv_caches[0][0].shape == (NUM_BLOCKS, BLOCK_SIZE, 1, 16)  # rank 1's KV head only
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    w = full_attn.qkv_proj.weight
    assert torch.equal(attn.qkv_proj.weight[:32], w[32:q])  # query heads 2 and 3
    assert torch.equal(attn.qkv_proj.weight[32:48], w[q + 16 : q + kv])  # KV head 1's keys
    assert torch.equal(attn.o_proj.weight, full_attn.o_proj.weight[:, 32:])
    if attn.o_proj.bias is not None:  # added once, by rank 0
        assert not attn.o_proj.bias.any()


def test_row_parallel_bias_is_kept_by_rank_zero_only():
    weight, bias = torch.randn(6, 4), torch.randn(6)
    rows = dict(shard_weights([("x.o_proj.weight", weight), ("x.o_proj.bias", bias)], 0, 2))
    others = dict(shard_weights([("x.o_proj.weight", weight), ("x.o_proj.bias", bias)], 1, 2))
    assert torch.equal(rows["x.o_proj.weight"], weight[:, :2]) and torch.equal(others["x.o_proj.weight"], weight[:, 2:])
    assert torch.equal(rows["x.o_proj.bias"], bias) and not others["x.o_proj.bias"].any()
    x = torch.randn(3, 4)
    summed = x[:, :2] @ rows["x.o_proj.weight"].T + rows["x.o_proj.bias"]
    summed += x[:, 2:] @ others["x.o_proj.weight"].T + others["x.o_proj.bias"]
    torch.testing.assert_close(summed, x @ weight.T + bias)


def test_sizes_that_do_not_divide_the_heads_are_refused():
    smollm2 = LlamaArgs("LlamaForCausalLM", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 1e5, 8192, True)
    assert divisible_sizes(smollm2) == [1, 3]
    check_size(smollm2, 3)
    with pytest.raises(ValueError, match=r"9 attention heads, 3 KV heads .*sizes that do: 1, 3"):
        check_size(smollm2, 2)


def test_every_rank_takes_the_block_count_of_the_smallest(model_dir):
    loaded, _ = load(model_dir, 0, 2)

    class SmallerElsewhere:
        rank = 0

        def min(self, value: int) -> int:
            return value // 3  # another rank holds a third as many blocks

    config = build_config(environ={"KVGRID_BLOCK_SIZE": str(BLOCK_SIZE)})
    alone = plan_rank(config, loaded, 64, 2**20, None)
    agreed = plan_rank(config, loaded, 64, 2**20, SmallerElsewhere())
    assert agreed.num_blocks == alone.num_blocks // 3
    assert agreed.kv_cache_bytes == agreed.num_blocks * loaded.block_bytes(BLOCK_SIZE)


def test_a_size_the_default_model_cannot_split_is_refused_in_one_line():
    line = _one_error_line(_run_worker("--tensor-parallel-size", "2"))
    assert "9 attention heads, 3 KV heads" in line and "sizes that do: 1, 3" in line


@pytest.mark.parametrize(
    "flags, problem",
    [
        ({"quantization": "gguf"}, "--quantization gguf cannot be split"),
        ({"cpu_kernels": "native"}, "--cpu-kernels native runs a whole unsharded layer"),
        ({"kv_tiers": "host"}, "--kv-tiers moves whole blocks of one KV cache"),
    ],
)
def test_options_a_sharded_model_cannot_take_are_refused(flags, problem):
    environ = {f"KVGRID_{k.upper()}": v for k, v in flags.items()}
    with pytest.raises(ModelLoadError, match=problem):
        check_options(build_config(environ=environ), 2)
    check_options(build_config(environ={}), 2)


def test_each_rank_takes_its_own_cuda_device_and_too_few_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    config = build_config(environ={"KVGRID_TENSOR_PARALLEL_SIZE": "2"})  # --device auto
    assert [rank_device(config, rank) for rank in range(2)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    four = build_config(environ={"KVGRID_TENSOR_PARALLEL_SIZE": "4"})
    with pytest.raises(ModelLoadError, match="--tensor-parallel-size 4 puts 4 ranks on each node, one CUDA device"):
        rank_device(four, 0)
    two_nodes = build_config(environ={"KVGRID_TENSOR_PARALLEL_SIZE": "4", "KVGRID_NNODES": "2"})
    assert [rank_device(two_nodes, rank) for rank in range(4)] == [torch.device("cuda", i) for i in (0, 1, 0, 1)]
    cpu = build_config(environ={"KVGRID_DEVICE": "cpu", "KVGRID_TENSOR_PARALLEL_SIZE": "4"})
    assert rank_device(cpu, 1) == torch.device("cpu")
