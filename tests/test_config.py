"""Configuration: flags beat KVGRID_* variables beat defaults; every bad value gets its own line."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from services.common import config as cfg


def parse(argv, environ=None, sections=cfg.ALL_SECTIONS):
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser, sections)
    return cfg.build_config(sections, parser.parse_args(argv), environ or {})


def test_defaults_match_the_design_ports():
    net = parse([]).network
    assert (net.tokenizer_port, net.http_port, net.scheduler_port, net.worker_port) == (50051, 8000, 50052, 50053)
    assert (net.scheduler_metrics_port, net.worker_metrics_port) == (8002, 8003)


def test_flag_beats_environment_beats_default():
    config = parse(["--max-num-seqs", "3"], {"KVGRID_MAX_NUM_SEQS": "9", "KVGRID_BLOCK_SIZE": "32"})
    assert config.scheduler.max_num_seqs == 3
    assert config.cache.block_size == 32
    assert config.cache.enable_prefix_caching is True


def test_sizes_and_booleans_parse_from_environment():
    config = parse([], {"KVGRID_KV_CACHE_MEMORY": "2GiB", "KVGRID_ENABLE_PREFIX_CACHING": "false"})
    assert config.cache.kv_cache_memory == 2 * 2**30
    assert config.cache.enable_prefix_caching is False


def test_every_bad_value_is_reported_on_its_own_line():
    with pytest.raises(cfg.ConfigError) as err:
        parse(["--block-size", "3", "--max-num-seqs", "0"], {"KVGRID_DTYPE": "int4", "KVGRID_WORKER_ADDR": "nohost"})
    lines = str(err.value).splitlines()
    assert len(lines) == 4
    assert any("--block-size" in line for line in lines)
    assert any("--max-num-seqs" in line for line in lines)
    assert any("KVGRID_DTYPE" in line and "int4" in line for line in lines)
    assert any("--worker-addr" in line for line in lines)


def test_to_flags_round_trips():
    config = parse(["--kv-cache-memory", "1MiB", "--no-enable-prefix-caching"])
    again = parse(cfg.to_flags(config.cache))
    assert again.cache == config.cache


def test_model_name_is_derived_from_the_path():
    assert cfg.model_name("") == cfg.DEFAULT_MODEL_NAME
    assert cfg.model_name("/models/Qwen2-0.5B/") == "Qwen2-0.5B"
    assert cfg.model_name("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"


def test_cli_reports_bad_flags_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "kvgrid.cli", "scheduler", "--block-size", "5"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert "--block-size must be a power of two" in proc.stderr
    assert "Traceback" not in proc.stderr
