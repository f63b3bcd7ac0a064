"""Servers the benchmark scripts start: a free loopback port, and a command run until its health route answers."""

import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, health: str = "/health", timeout: float = 300, proc: subprocess.Popen | None = None,
                 log=None) -> None:
    """Until url + health answers 200; raises when the timeout passes or `proc` exits (with `log`'s tail)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{proc.args[0]} exited: {log.read()[-3000:]}")
        try:
            if httpx.get(url + health, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not become healthy in {timeout:.0f} s")
        time.sleep(0.5)


@contextmanager
def running(cmd: list[str], url: str, health: str = "/health", timeout: float = 600) -> Iterator[subprocess.Popen]:
    """Run cmd until it answers `health` with 200; stop it afterwards (its log tail in the error if it dies)."""
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(url, health, timeout, proc, log)
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
