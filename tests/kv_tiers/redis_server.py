"""A real Redis for the KV tier tests: Debian's redis-server on a free port, nothing on disk."""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field

import pytest

from tests.procs import free_port, terminate

REDIS_SERVER = shutil.which("redis-server")
NOT_INSTALLED = "redis-server not installed: run `make test` as root or install it (apt-get install redis-server)"
needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason=NOT_INSTALLED)


@dataclass
class RedisServer:
    extra_args: list[str] = field(default_factory=list)
    port: int = 0
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Skips the calling test where redis-server is not installed."""
        if REDIS_SERVER is None:
            pytest.skip(NOT_INSTALLED)
        self.port = self.port or free_port()
        argv = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.process = subprocess.Popen([*argv, *self.extra_args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return self
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def client(self):
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=5)

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(10)
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            terminate(self.process, 10)
            self.process = None
