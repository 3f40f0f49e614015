"""``kvgrid serve --nnodes N``: the worker-rank children it adds, each given only the rendezvous and its node."""

from __future__ import annotations

import re

from kvgrid.cli import serve
from tests.test_cli_serve import parse


def test_two_nodes_add_a_worker_rank_child_that_starts_first_and_stops_last():
    config = serve.with_rendezvous(serve.child_config(parse(["--pipeline-parallel-size", "2", "--nnodes", "2"])))
    method = config.parallel.distributed_init_method
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", method)
    children = serve.build_children(config)
    assert [c.name for c in children] == ["worker-rank-1", "worker", "scheduler", "tokenizer"]
    node = children[0]
    assert node.argv[1:6] == ["-m", "kvgrid.cli", "worker-rank", "--node-rank", "1"]
    assert node.argv[6:8] == ["--distributed-init-method", method] and node.stage == "worker-rank"
    worker = children[1].argv
    assert worker[worker.index("--distributed-init-method") + 1] == method
    assert worker[worker.index("--nnodes") + 1] == "2"


def test_one_node_adds_nothing_and_keeps_the_init_method_empty():
    config = serve.with_rendezvous(serve.child_config(parse(["--pipeline-parallel-size", "2"])))
    assert config.parallel.distributed_init_method == ""
    assert [c.name for c in serve.build_children(config)] == ["worker", "scheduler", "tokenizer"]
