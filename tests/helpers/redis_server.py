"""A real redis-server for the shared-store tests (Debian's package; `make test` installs it): 127.0.0.1, a free
port, no persistence. kill() and start() again on the same port drill an outage."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
import redis

# small stream nodes, so that MAXLEN ~ trims after a few events (the gap test) instead of after a hundred
ARGS = ("--save", "", "--appendonly", "no", "--bind", "127.0.0.1", "--stream-node-max-entries", "4")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """args: more redis-server options, after the defaults (the later one wins: e.g. --appendonly yes --dir D)."""

    def __init__(self, *args: str):
        self.args = args
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.skip("redis-server is not installed (`make system-packages` installs it)")
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> RedisServer:
        self.process = subprocess.Popen([self.binary, "--port", str(self.port), *ARGS, *self.args], stdout=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: no goodbye to the clients, as a crashed or unplugged Redis."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(port=self.port, db=db)
