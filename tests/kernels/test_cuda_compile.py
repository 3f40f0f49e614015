"""The CUDA path without a GPU: every kernel compiles for sm_80 and sm_90 (compile_for_cuda.py says why)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_kernels_compile_for_ampere_and_hopper(tmp_path):
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this triton build has no NVIDIA backend")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "tests.kernels.compile_for_cuda", "80", "90"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("compiled ") == 12, result.stdout
    assert any(path.suffix == ".cubin" for path in tmp_path.rglob("*")), "ptxas produced no cubin"
