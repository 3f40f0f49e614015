"""Shared test setup: the Triton interpreter on machines without CUDA, CUDA-only tests skipped."""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest

# Must be set before triton is first imported: kernels run on CPU tensors through the interpreter.
if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if any("cuda" in item.keywords for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
