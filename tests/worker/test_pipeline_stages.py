"""Pipeline stages without processes: the layer split, each stage's weights, and what a staged worker refuses.

Two stages run in one thread here, stage 0's output handed to stage 1 as the group's send and receive would:
their logits equal the whole model's bit for bit. The real ranks (gloo, the control channel, a killed rank)
are tested end to end in tests/e2e/test_pipeline_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

from services.common.config import ConfigError, build_config
from services.worker.models.llama import LlamaArgs
from services.worker.parallel.group import Layout
from services.worker.parallel.plan import check_options
from services.worker.parallel.stages import check_stages, drop_unused_weights, layer_ranges, stage_weights
from services.worker.setup.build import create_runner, load_model
from services.worker.setup.loader import ModelLoadError
from tests.worker.test_cli_errors import _one_error_line, _run_worker
from tests.worker.tiny import request, save_tiny_model

BLOCK_SIZE = 4


def test_layers_split_into_contiguous_stages_with_the_extra_ones_last():
    assert layer_ranges(4, 2) == [(0, 2), (2, 4)]
    assert layer_ranges(4, 3) == [(0, 1), (1, 2), (2, 4)]
    assert layer_ranges(30, 4) == [(0, 7), (7, 14), (14, 22), (22, 30)]
    assert layer_ranges(3, 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="--pipeline-parallel-size 5 exceeds the model's 4 layers"):
        layer_ranges(4, 5)


def test_a_stage_keeps_its_layers_renumbered_and_everything_outside_the_layers():
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    names += [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(4)]
    names += ["model.layers.10.mlp.up_proj.weight"]
    kept = [name for name, _ in stage_weights(((n, None) for n in names), (2, 4))]
    assert kept == [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
    ]


def test_two_stages_in_turn_give_the_logits_of_the_whole_model(tmp_path):
    path = save_tiny_model(str(tmp_path), num_hidden_layers=4)

    def runner(layers=None):
        loaded = load_model(path, dtype="float32", device="cpu", cpu_kernels="torch", layers=layers)
        return create_runner(loaded, BLOCK_SIZE, 32)

    whole, stages = runner(), [runner(r) for r in layer_ranges(4, 2)]
    assert [len(s.kv_caches) for s in stages] == [2, 2] and len(whole.kv_caches) == 4
    for step in range(2):
        requests = [request("a", list(range(3, 14)), [9, 4, 17, 21], 0, 11)]
        if step:  # a decode after the prompt
            requests[0].token_ids.append(5)
            requests[0].num_computed_tokens, requests[0].num_scheduled_tokens = 11, 1
        outs = []
        for runners in ([whole], stages):
            inputs = runners[0].prepare(requests)
            hidden = None
            for r in runners:
                hidden = r.model(inputs.input_ids, inputs.positions, r.kv_caches, inputs.meta, hidden)
            outs.append(runners[0].model.compute_logits(hidden[inputs.logits_indices]))
        assert torch.equal(outs[0], outs[1])


def test_ranks_free_the_embedding_and_logits_head_they_never_run(tmp_path):
    path = save_tiny_model(str(tmp_path), num_hidden_layers=4)
    sizes = {}
    for rank in (0, 1, 2):  # two stages of two tensor-parallel ranks: rank 1 is stage 0, rank 2 stage 1
        model = load_model(path, dtype="float32", device="cpu", cpu_kernels="torch", layers=(0, 2)).model
        freed = drop_unused_weights(model, Layout(rank, tp=2, pp=2))
        sizes[rank] = (model.embed_tokens.weight.numel(), model.lm_head.weight.numel(), freed)
    embed, head = 160 * 64, 160 * 64  # vocab x hidden, untied
    assert sizes == {0: (embed, head, 0), 1: (embed, 0, 4 * head), 2: (0, 0, 4 * (embed + head))}


def test_families_the_split_does_not_map_are_refused():
    args = LlamaArgs("Gemma3ForCausalLM", 10, 8, 8, 6, 2, 1, 4, 1e-6, 1e4, 64, True)
    with pytest.raises(ValueError, match="gemma3_text models run in one stage"):
        check_stages("gemma3_text", args, 2)
    check_stages("qwen2", args, 2)


@pytest.mark.parametrize(
    "flags, problem",
    [
        ({"quantization": "gguf"}, "--quantization gguf is not split into --pipeline-parallel-size 2 stages"),
        ({"cpu_kernels": "native"}, "--cpu-kernels native runs the whole model per call"),
        ({"kv_tiers": "host"}, "with --pipeline-parallel-size 2 each stage holds its layers' share"),
        (
            {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}'},
            "not served with --pipeline-parallel-size 2 yet",
        ),
    ],
)
def test_options_a_staged_model_cannot_take_are_refused(flags, problem):
    environ = {f"KVGRID_{k.upper()}": v for k, v in flags.items()} | {"KVGRID_PIPELINE_PARALLEL_SIZE": "2"}
    with pytest.raises(ModelLoadError, match=problem):
        check_options(build_config(environ=environ), 1)
    check_options(build_config(environ={"KVGRID_PIPELINE_PARALLEL_SIZE": "2"}), 1)


def test_group_flags_are_checked():
    bad = {"KVGRID_PIPELINE_PARALLEL_SIZE": "3", "KVGRID_NNODES": "2", "KVGRID_DISTRIBUTED_INIT_METHOD": "host:1"}
    with pytest.raises(ConfigError) as error:
        build_config(environ=bad)
    assert "--nnodes 2 must divide the 3 ranks" in str(error.value)
    assert "--distributed-init-method must be tcp://HOST:PORT, got 'host:1'" in str(error.value)
    good = {
        "KVGRID_PIPELINE_PARALLEL_SIZE": "2",
        "KVGRID_NNODES": "2",
        "KVGRID_DISTRIBUTED_INIT_METHOD": "tcp://[::1]:1",
    }
    assert build_config(environ=good).parallel.world_size == 2


def test_more_stages_than_the_default_model_has_layers_are_refused_in_one_line():
    line = _one_error_line(_run_worker("--pipeline-parallel-size", "31"))
    assert "--pipeline-parallel-size 31 exceeds the model's 30 layers" in line
