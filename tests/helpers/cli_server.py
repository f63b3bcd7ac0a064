"""`strata serve` as a user runs it, in a process of its own on a free loopback port (signals, exit codes, orphans)."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx


def start_cli_server(*flags: str, stderr=subprocess.DEVNULL) -> tuple[subprocess.Popen, str]:
    """(the server process, its base URL)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "strata.server.cli", "serve", "--port", str(port), *flags],
                              stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    return server, f"http://127.0.0.1:{port}"


def wait_healthy(server: subprocess.Popen, url: str, timeout: float) -> None:
    """Until /health answers 200; fails if the process exits first or the time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        assert server.poll() is None, "strata serve exited before it served"
        assert time.monotonic() < deadline, f"strata serve did not serve within {timeout} s"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
