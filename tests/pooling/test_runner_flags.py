"""--runner, --pooling-type, --normalize and vLLM's --task alias, from flags and KVGRID_* variables."""

from __future__ import annotations

import argparse

import pytest

from services.common import config as cfg


def parse(argv, environ=None):
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser)
    return cfg.build_config(cfg.ALL_SECTIONS, parser.parse_args(argv), environ or {}).model


def test_defaults_generate():
    model = parse([])
    assert (model.runner, model.pooling_type, model.normalize, model.task) == ("generate", "last", True, "auto")


def test_pooling_flags_and_variables():
    model = parse(["--runner", "pooling", "--pooling-type", "mean", "--no-normalize"])
    assert (model.runner, model.pooling_type, model.normalize) == ("pooling", "mean", False)
    model = parse([], {"KVGRID_RUNNER": "pooling", "KVGRID_POOLING_TYPE": "cls", "KVGRID_NORMALIZE": "false"})
    assert (model.runner, model.pooling_type, model.normalize) == ("pooling", "cls", False)


def test_task_embed_is_the_pooling_runner():
    assert parse(["--task", "embed"]).runner == "pooling"
    assert parse([], {"KVGRID_TASK": "embed"}).runner == "pooling"
    with pytest.raises(cfg.ConfigError, match="--task generate contradicts --runner pooling"):
        parse(["--task", "generate", "--runner", "pooling"])
    with pytest.raises(cfg.ConfigError, match="KVGRID_POOLING_TYPE must be one of last, mean, cls"):
        parse([], {"KVGRID_POOLING_TYPE": "max"})
