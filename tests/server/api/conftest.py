"""One HTTP server for this package's modules that use the hash tiers: a start (engine process, real default model)
costs 10-25 s on 2 cores, and eight modules each started their own."""
import time

import pytest
from helpers.http_server import KEYS, hash_semantic, start_server


@pytest.fixture(scope="package")
def hash_server():
    with start_server(hash_semantic()) as srv:
        yield srv


@pytest.fixture(scope="module")
def server(hash_server):
    """Each module starts from an empty request cache, with the engine idle and its KV block count noted."""
    hash_server.settle()
    for tenant in sorted(set(KEYS.values())):
        hash_server.cache.invalidate(tenant=tenant)
    deadline = time.monotonic() + 30
    while (stats := hash_server.stats())["num_running"] + stats["num_waiting"] + stats["num_swapped"]:
        assert time.monotonic() < deadline, "the previous module left requests running"
        time.sleep(0.05)
    hash_server.idle = stats["kv_blocks_used"]
    return hash_server
