"""The attention benchmark is for CUDA machines; elsewhere it must say so and succeed."""

from __future__ import annotations

import pytest
import torch

from benchmarks import attention_bench


def test_without_cuda_exits_zero(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the real benchmark")
    assert attention_bench.main([]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_nominal_bandwidth_prefers_specific_names():
    assert attention_bench.nominal_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert attention_bench.nominal_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert attention_bench.nominal_bandwidth("NVIDIA H200") == 4.8e12
    assert attention_bench.nominal_bandwidth("Some Future GPU") is None
