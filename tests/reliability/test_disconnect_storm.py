"""Disconnect storm: 48 streaming clients, a third of them asking the same question, leave at random points (before
the first byte, mid-stream, or never); every sequence is aborted and its blocks freed, nobody waits on a leader that
left, and the server answers normally afterwards."""
from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from helpers.http_server import hash_semantic, start_server

from strata.server.api.config import ServerConfig

pytestmark = [pytest.mark.http, pytest.mark.slow]


def test_disconnect_storm_frees_everything_and_leaves_no_follower_waiting(tiny_chat_engine):
    with start_server(hash_semantic(), ServerConfig(default_max_tokens=8), engine=tiny_chat_engine) as server:
        rng = random.Random(7)

        def body(i: int) -> dict:
            question = "Tell the story of the lighthouse." if i % 3 == 0 else f"Tell story number {i}."
            return {"model": server.model, "messages": [{"role": "user", "content": question}], "max_tokens": 200,
                    "temperature": 0, "stream": True, "cache_tags": ["storm"]}

        async def client(http: httpx.AsyncClient, i: int) -> str:
            leave_after = rng.choice([0, 1, 3, 10, None])           # chunks read before leaving; None = stay
            async with http.stream("POST", "/v1/chat/completions", json=body(i)) as res:
                if res.status_code != 200:
                    return f"status {res.status_code}"
                if leave_after == 0:
                    return "left before reading"
                seen = 0
                async for line in res.aiter_lines():
                    if line.startswith("data:"):
                        seen += 1
                        if leave_after is not None and seen >= leave_after:
                            return "left mid-stream"
                        if '"error"' in line:
                            return "error in stream"
                return "complete"

        async def storm():
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits,
                                         headers={"Authorization": "Bearer key-acme"}) as http:
                return await asyncio.wait_for(asyncio.gather(*[client(http, i) for i in range(48)]), 120)

        outcomes = asyncio.run(storm())
        assert "error in stream" not in outcomes and not any(o.startswith("status") for o in outcomes), outcomes
        assert outcomes.count("complete") >= 5 and outcomes.count("left mid-stream") >= 5
        assert server.idle_blocks(0, timeout=10) == 0                       # every aborted sequence freed its blocks
        engine_client = server.app.state.completer.engine
        assert engine_client.num_pending == 0
        server.settle()         # an answered flight stays joinable until its write lands, then goes
        deadline = time.monotonic() + 5
        while server.cache.flights.flights and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server.cache.flights.flights                             # no leader left behind
        with server.http() as http:                                         # and it still answers
            res = http.post("/v1/chat/completions", json=dict(body(1), stream=False, max_tokens=4))
        assert res.status_code == 200
