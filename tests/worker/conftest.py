"""Worker tests run torch on one thread: the test machine's cores are shared, and with several
threads every small op waits on its slowest thread. Restored after each module."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
