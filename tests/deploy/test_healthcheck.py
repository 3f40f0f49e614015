"""python -m kvgrid.cli.healthcheck: the container health check exits 0 only for SERVING."""

from __future__ import annotations

import asyncio

import pytest

from kvgrid.cli import healthcheck
from services.common.server import Health, bind, new_server
from tests.procs import free_port

pytestmark = pytest.mark.timeout(60)


def _run_check(argv: list[str]) -> int:
    return healthcheck.main(argv)


async def _serve_and_check(serving: bool, service: str = "") -> int:
    server = new_server()
    health = Health(server, ["kvgrid.v1.Worker"])
    port = bind(server, "127.0.0.1", 0)
    await server.start()
    try:
        health.set(serving)
        return await asyncio.to_thread(_run_check, [f"127.0.0.1:{port}", service, "--timeout", "5"])
    finally:
        await server.stop(None)


def test_serving_exits_zero(capsys):
    assert asyncio.run(_serve_and_check(True)) == 0
    assert "SERVING" in capsys.readouterr().out


def test_not_serving_exits_one():
    assert asyncio.run(_serve_and_check(False)) == 1
    assert asyncio.run(_serve_and_check(False, "kvgrid.v1.Worker")) == 1


def test_unknown_service_and_unreachable_server_exit_one(capsys):
    assert asyncio.run(_serve_and_check(True, "kvgrid.v1.Nope")) == 1
    assert _run_check([f"127.0.0.1:{free_port()}", "--timeout", "1"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err
