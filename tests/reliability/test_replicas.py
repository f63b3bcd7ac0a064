"""Two replicas behind one Redis (--cache-redis), over real HTTP with a real redis-server: what one answers the other
serves (exact, and a paraphrase semantically), an invalidation on one is gone on the other, tenants stay apart, and
a Redis killed under load costs no request: both keep answering from their in-process layers, and once Redis is back
the answers written meanwhile reach it and the other replica."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import pytest
import torch
from helpers.http_server import ADMIN, admin, ask, hash_semantic, start_server
from helpers.redis_server import RedisServer

from strata.cache.request.config import RequestCacheConfig
from strata.server.api.config import ServerConfig

pytestmark = [pytest.mark.http, pytest.mark.slow]


@pytest.fixture(scope="module")
def replicas(tiny_chat_engine):
    """Redis, then replicas A and B on it: the tiny chat model, the hash embedder's fixed tiers."""
    with ExitStack() as stack:
        stack.callback(torch.set_num_threads, torch.get_num_threads())    # the two starts below race to restore it
        redis_server = RedisServer().start()
        stack.callback(redis_server.kill)
        cache = RequestCacheConfig(redis=redis_server.url(), lease_wait_s=1.0)
        starts = [start_server(hash_semantic(), ServerConfig(default_max_tokens=8), engine=tiny_chat_engine, cache=cache)
                  for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:         # the two engines load at the same time
            entered = [pool.submit(start.__enter__) for start in starts]
        for start in starts:
            stack.push(start)
        a, b = (future.result() for future in entered)
        yield redis_server, a, b


def synced(server, check, timeout=5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check(server.cache):
        assert time.monotonic() < deadline, server.cache.stats().get("redis")
        time.sleep(0.02)


def test_what_one_replica_answered_the_other_serves(replicas):
    _, a, b = replicas
    assert ask(a, "Explain how tides work on the ocean.")[0] == "miss"
    a.settle()
    assert ask(b, "Explain how tides work on the ocean.")[0] == "exact"
    synced(b, lambda cache: len(cache.semantic) >= 1)
    layer, similarity, _ = ask(b, "Explain how the tides work on the ocean.")
    assert layer.startswith("semantic") and float(similarity) > 0.85


def test_an_invalidation_on_one_replica_is_gone_on_the_other(replicas):
    _, a, b = replicas
    layer, _, _ = ask(a, "Summarise the storm warning.", extra_body={"cache_tags": ["weather-alert"]})
    a.settle()
    assert layer == "miss" and ask(a, "Summarise the storm warning.")[0] == "exact"
    (entry_id,) = a.cache.store.ids(tag="weather-alert")
    res = admin(b, "/admin/cache/invalidate", json={"tag": "weather-alert"})
    assert res.status_code == 200 and res.json()["deleted"] == 1
    synced(a, lambda cache: entry_id not in cache.semantic.ids())       # the stream's delete event reached A
    assert ask(a, "Summarise the storm warning.")[0] == "miss"


def test_two_tenants_never_see_each_others_entries(replicas):
    _, a, b = replicas
    assert ask(a, "Describe our onboarding checklist.", key="key-acme")[0] == "miss"
    a.settle()
    assert ask(b, "Describe our onboarding checklist.", key="key-globex")[0] == "miss"
    assert ask(b, "Describe our onboarding checklist.", key="key-acme")[0] == "exact"


def test_redis_killed_under_load_then_restarted(replicas):
    redis_server, a, b = replicas
    questions = [f"Give me tip number {i % 12} for writing clear code." for i in range(200)]

    async def load(until: float) -> list[int]:
        statuses = []

        async def client(server, offset: int):
            async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                         headers={"Authorization": "Bearer key-acme"}) as http:
                i = offset
                while time.monotonic() < until:
                    res = await http.post("/v1/chat/completions", json={
                        "model": server.model, "messages": [{"role": "user", "content": questions[i % 200]}],
                        "max_tokens": 8, "temperature": 0})
                    statuses.append(res.status_code)
                    i += 7

        await asyncio.gather(*[client(server, n) for server in (a, b) for n in range(3)])
        return statuses

    async def drill() -> list[int]:
        loading = asyncio.ensure_future(load(time.monotonic() + 4))
        await asyncio.sleep(1.5)
        redis_server.kill()
        return await loading

    statuses = asyncio.run(drill())
    assert len(statuses) > 20 and set(statuses) == {200}, sorted(set(statuses))
    synced(a, lambda cache: not cache.stats()["redis"]["up"])
    with a.http() as http:
        health = http.get("/health").json()
    assert health["status"] == "degraded" and "redis down" in health["reason"]
    with a.http(ADMIN) as http:
        metrics = http.get("/metrics").text
    assert "strata_cache_redis_up 0.0" in metrics and "strata_cache_redis_malformed_entries_total 0.0" in metrics
    outage = ["Why do cats purr when they sleep?", "Compare TCP and UDP for video calls.",
              "List three uses of a binary heap."]
    for question in outage:                 # answered by A while Redis is down: queued
        assert ask(a, question)[0] == "miss"
    a.settle()
    assert a.cache.stats()["redis"]["queue"] >= 3
    redis_server.start()
    for server in (a, b):
        synced(server, lambda cache: cache.stats()["redis"]["up"], timeout=10)
    assert a.cache.stats()["redis"]["queue"] == 0 and a.cache.stats()["redis"]["dropped"] == 0
    for question in outage:                 # A's outage-time answers reached Redis and B
        assert ask(b, question)[0] == "exact"
    with b.http() as http:
        assert "redis" not in http.get("/health").json().get("reason", "")
