"""Request-cache latency in-process: exact hit (memory and store), miss + write-back, bypass, key building.

exact_hit_memory: a hot question (policy and templating memos warm, the usual case for a repeated question);
exact_hit_memory_unmemoized_rules: the same with those memos cleared before each call (worst case).

Prints JSON. Usage: HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/request_cache_latency.py [--n 20000] [--note "..."]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time

from strata.cache.request.keys import build_key
from strata.cache.request.request_cache import CacheRequest, RequestCache, RequestCacheConfig
from strata.cache.request.templating import template_request

ANSWER = "Paris is the capital of France. " * 20         # ~640 characters, a typical short answer


def chat(text: str, **sampling) -> CacheRequest:
    return CacheRequest("default", "SmolLM2-135M-Instruct@bench", [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": text}], sampling or {"temperature": 0, "max_tokens": 256})


def summary(samples_ns: list[int]) -> dict:
    us = sorted(s / 1000 for s in samples_ns)
    pick = lambda q: round(us[min(len(us) - 1, int(q * len(us)))], 2)
    return {"n": len(us), "p50_us": pick(0.5), "p90_us": pick(0.9), "p99_us": pick(0.99),
            "mean_us": round(statistics.fmean(us), 2)}


async def timed(n: int, make_call, before=lambda: None) -> list[int]:
    out = []
    for i in range(n):
        before()
        call = make_call(i)
        t0 = time.perf_counter_ns()
        await call
        out.append(time.perf_counter_ns() - t0)
    return out


async def main(n: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cache = RequestCache(RequestCacheConfig(db=os.path.join(tmp, "bench.db")))

        def forget_rules() -> None:     # drop the policy/templating memos: the hit pays for the full classification
            template_request.cache_clear()
            cache.policy.bypass_reason.cache_clear()
            cache.policy.ttl_class.cache_clear()
        questions = [f"What is the capital of country number {i}?" for i in range(1000)]

        async def miss_and_write(i: int) -> None:
            lookup = await cache.lookup(chat(questions[i % 1000] + f" v{i // 1000}"))
            lookup.complete(ANSWER)

        miss = await timed(min(n, 5000), miss_and_write)
        await cache.drain()
        for q in questions:
            (await cache.lookup(chat(q))).complete(ANSWER)
        await cache.drain()
        hits = await timed(n, lambda i: cache.lookup(chat(questions[i % 1000])))
        cold_rules = await timed(min(n, 5000), lambda i: cache.lookup(chat(questions[i % 1000])), before=forget_rules)
        cache.exact.memory.clear()
        store_hits = await timed(1000, lambda i: cache.lookup(chat(questions[i])))   # each promoted after its first read
        bypass = await timed(n, lambda i: cache.lookup(chat("What's the weather in Paris today?")))
        keys = []
        for i in range(n):
            req = chat(questions[i % 1000])
            t0 = time.perf_counter_ns()
            build_key(req)
            keys.append(time.perf_counter_ns() - t0)
        layers = cache.stats()["counters"]
        cache.close()
    assert layers["exact"]["hit"] == n + min(n, 5000) + 1000, layers
    return {"exact_hit_memory": summary(hits), "exact_hit_memory_unmemoized_rules": summary(cold_rules), "exact_hit_store": summary(store_hits),
            "miss_lookup_plus_complete": summary(miss), "bypass_decision": summary(bypass), "build_key": summary(keys)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--note", default="", help="what machine this ran on (free text)")
    args = parser.parse_args()
    results = asyncio.run(main(args.n))
    print(json.dumps({"benchmark": "request_cache_latency", "note": args.note,
                      "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                                  "python": platform.python_version(), "platform": platform.platform(),
                                  "loadavg_1m_at_end": round(os.getloadavg()[0], 2)},
                      "semantic": "off (exact layer only)", "results": results}, indent=2))
