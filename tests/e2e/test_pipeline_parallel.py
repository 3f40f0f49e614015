"""``kvgrid serve --pipeline-parallel-size P`` on CPU (gloo) on a tiny float32 Llama of 4 layers.

Greedy output over the e2e prompts, sent at once into a KV cache small enough to preempt, equals one rank's
(the offline engine in this process, on the same weights) token for token, with two plans over disjoint
requests in the pipeline at once (micro-batches, which rank 0 logs); an aborted stream frees its blocks
and leaves the others exact. The slow variants: three stages; two stages of two tensor-parallel ranks (the
all-reduces sum in another order, greedy tokens stay); and two "nodes" on this machine, the second's
ranks started by ``kvgrid worker-rank`` from the rendezvous address alone, where a ``kill -9`` of one of its
ranks takes the group down, serve restarts it, and the requests the scheduler parked finish exact.
"""

from __future__ import annotations

import re
import subprocess
import time

import grpc
import pytest

from kvgrid.v1 import common_pb2, generate_pb2
from tests.e2e.stack import Stack, get_stats, running_stack, wait_idle
from tests.e2e.test_equivalence import PROMPTS
from tests.faults.streams import Streams
from tests.worker.tiny import save_tiny_bytelevel_tokenizer, save_tiny_model

pytestmark = pytest.mark.timeout(400)

MAX_TOKENS = 32
LONG = 120  # streams that are still running when a test aborts one or kills a rank
# 400 KiB of float32 KV split over the ranks: 25 blocks of 16 tokens with two stages (16 with three), fewer than the
# nine prompts need at once, so the scheduler preempts.
ARGS = ["--dtype", "float32", "--kv-cache-memory", "400KiB", "--max-model-len", "256", "--num-threads", "1"]
ARGS += ["--max-num-seqs", "16"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("pp-model"))
    save_tiny_model(path, num_hidden_layers=4, vocab_size=300, max_position_embeddings=512)
    save_tiny_bytelevel_tokenizer(path)  # 263 ids
    return path


@pytest.fixture(scope="module")
def reference(model) -> dict[tuple[str, int], list[int]]:
    """Greedy tokens of one rank (the offline engine), by (prompt, max_tokens)."""
    from kvgrid import LLM, SamplingParams

    llm = LLM(model, dtype="float32", max_model_len=256, kv_cache_memory="4MiB", cpu_kernels="torch", num_threads=1)
    out = {}
    for prompts, max_tokens in ((PROMPTS, MAX_TOKENS), (PROMPTS[:4], LONG)):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        for prompt, result in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
            out[prompt, max_tokens] = result.token_ids
    return out


def request(prompt: str, max_tokens: int = MAX_TOKENS) -> generate_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return generate_pb2.GenerateRequest(prompt=prompt, sampling=sampling, request_id=f"pp-{time.time_ns()}")


def check_prompts_through_preemption(stack: Stack, reference, max_tokens: int = MAX_TOKENS) -> None:
    with grpc.insecure_channel(stack.scheduler_addr) as channel:
        before = get_stats(channel).num_preemptions
        outcomes = Streams(stack.addr, [request(p, max_tokens) for p in PROMPTS]).wait()
        stats = wait_idle(channel)
    assert all(o.ok for o in outcomes), [(o.code, o.details) for o in outcomes]
    assert [o.token_ids for o in outcomes] == [reference[p, max_tokens] for p in PROMPTS]
    assert stats.num_preemptions > before, "the cache should be too small for all the prompts at once"
    assert (stats.num_running, stats.num_waiting, stats.num_blocks_used) == (0, 0, 0)


@pytest.fixture(scope="module")
def two_stages(model, tmp_path_factory):
    log = tmp_path_factory.mktemp("pp2") / "serve.log"
    with running_stack(log, ["--model", model, "--pipeline-parallel-size", "2", *ARGS]) as stack:
        yield stack


def test_two_stages_give_one_ranks_greedy_tokens_through_preemption(two_stages, reference):
    check_prompts_through_preemption(two_stages, reference)
    assert re.search(r"pipeline stages' layers: \[0, 2\), \[2, 4\)", two_stages.log())
    # Micro-batches: rank 0 had a second plan (disjoint requests) through stage 0 while the first was still in the
    # pipeline, and the tokens above are still one rank's.
    assert "micro-batches: 2 plans in the pipeline at once" in two_stages.log()


def test_an_aborted_stream_frees_its_blocks_and_the_others_stay_exact(two_stages, reference):
    requests = [request(p, LONG) for p in PROMPTS[:3]]
    streams = Streams(two_stages.addr, requests)
    assert streams.wait_tokens(4) == len(requests)
    streams.calls[1].cancel()
    outcomes = streams.wait()
    assert outcomes[1].code == grpc.StatusCode.CANCELLED
    assert [outcomes[i].token_ids for i in (0, 2)] == [reference[PROMPTS[i], LONG] for i in (0, 2)]
    with grpc.insecure_channel(two_stages.scheduler_addr) as channel:
        stats = wait_idle(channel)
    assert (stats.num_running, stats.num_waiting, stats.num_blocks_used) == (0, 0, 0)


@pytest.mark.slow
def test_three_stages_give_one_ranks_greedy_tokens_through_preemption(model, reference, tmp_path):
    with running_stack(tmp_path / "serve.log", ["--model", model, "--pipeline-parallel-size", "3", *ARGS]) as stack:
        check_prompts_through_preemption(stack, reference)
        assert re.search(r"pipeline stages' layers: \[0, 1\), \[1, 2\), \[2, 4\)", stack.log())
        assert "micro-batches: 2 plans in the pipeline at once" in stack.log()


@pytest.mark.slow
def test_two_stages_of_two_tensor_parallel_ranks_give_one_ranks_greedy_tokens(model, reference, tmp_path):
    args = ["--model", model, "--pipeline-parallel-size", "2", "--tensor-parallel-size", "2", *ARGS]
    with running_stack(tmp_path / "serve.log", args) as stack:
        check_prompts_through_preemption(stack, reference)
        assert "worker group: 4 ranks (tensor parallel 2 x pipeline parallel 2, gloo, 1 nodes)" in stack.log()
        # Stage 0's second rank sends one micro-batch on while it computes the next with rank 0: no rank waits
        # on another in a cycle.
        assert "micro-batches: 2 plans in the pipeline at once" in stack.log()


def node_rank_pid(stack: Stack, after: int = 0) -> int:
    """Rank 1's pid on node 1, from the latest start of its kvgrid worker-rank after log offset ``after``."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = re.findall(r"node 1 of 2: rank pids 1 pid (\d+)", stack.log()[after:])
        if found:
            return int(found[-1])
        time.sleep(0.5)
    raise TimeoutError(stack.log()[-4000:])


@pytest.mark.slow
def test_ranks_of_a_second_node_join_by_address_and_a_killed_one_restarts_the_group(model, reference, tmp_path):
    args = ["--model", model, "--pipeline-parallel-size", "2", "--nnodes", "2", *ARGS]
    with running_stack(tmp_path / "serve.log", args) as stack:
        node = r"-m kvgrid.cli worker-rank --node-rank 1 --distributed-init-method tcp://127\.0\.0\.1:\d+ --log-level"
        assert re.search(node, ps(stack)), ps(stack)
        check_prompts_through_preemption(stack, reference)
        streams = Streams(stack.addr, [request(p, LONG) for p in PROMPTS[:4]])
        assert streams.wait_tokens(3) == 4, "the streams should be mid-way when the rank dies"
        mark = len(stack.log())
        subprocess.run(["kill", "-9", str(node_rank_pid(stack))], check=True)
        outcomes = streams.wait()
        assert all(o.ok for o in outcomes), [(o.code, o.details) for o in outcomes]
        assert [o.token_ids for o in outcomes] == [reference[p, LONG] for p in PROMPTS[:4]]
        log = stack.log()[mark:]
        assert "worker-group rank 1 closed its control channel" in log, log[-4000:]
        assert re.search(r"restarted the worker-rank-1 \(pid \d+\)", log) and "restarted the worker (pid" in log
        assert "requests of the lost worker by recompute" in log
        with grpc.insecure_channel(stack.scheduler_addr) as channel:
            stats = wait_idle(channel)
        assert (stats.num_running, stats.num_waiting, stats.num_blocks_used) == (0, 0, 0)
        # SIGTERM: the worker stops its group in order, so the second node's ranks end cleanly before serve stops it
        assert stack.terminate() == 0
        assert "node 1: rank 0 stopped the group" in stack.log()[mark:]


def ps(stack: Stack) -> str:
    """The command lines of serve's children."""
    return subprocess.run(
        ["ps", "-ww", "-o", "args=", "--ppid", str(stack.process.pid)], capture_output=True, text=True
    ).stdout
