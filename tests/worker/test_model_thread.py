"""The worker loads its model on the thread that runs its steps: OpenMP keeps one thread team per
calling thread, and a second team on a small machine makes every parallel region pay a wake-up."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from services.worker import server
from tests.worker.smollm import worker_config


def test_build_core_runs_on_the_model_thread(monkeypatch):
    loaded_on = []

    def fake_build_core(config, metrics):
        loaded_on.append(threading.current_thread())
        return SimpleNamespace(handshake=SimpleNamespace(num_blocks=1), ranks=None)

    monkeypatch.setattr(server, "build_core", fake_build_core)

    async def run():
        worker = await server.start_worker(worker_config(), 0)
        try:
            step_thread = worker.servicer.model_thread.submit(threading.current_thread).result()
        finally:
            await worker.stop(None)
        return step_thread

    step_thread = asyncio.run(run())
    assert loaded_on == [step_thread] and step_thread is not threading.main_thread()
