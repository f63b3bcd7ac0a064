"""HTTP load over loopback: N concurrent streaming clients ask a mix of repeated, paraphrased and new questions.

Starts its own `strata serve` subprocess (real default model, request cache with the chosen embedder; its own
process so client and server never share a GIL) on a free 127.0.0.1 port and prints JSON: p50/p95 latency (to the
last SSE byte) and TTFT per cache layer, requests/s, each layer's share, and the CPU share of the HTTP process, the
engine process and this client while loaded.

The client is aiohttp on uvloop and parses only each stream's first chunk: it shares the 2 cores with the server, and
an httpx client cost ~1.2 ms per request of its own (p50 of an idle exact hit: 1.3-1.8 ms with httpx, 0.7 with
aiohttp, 0.45 with a raw socket).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/http_load.py --clients 8 --requests 200 --max-tokens 16 \
        --out benchmarks/results/http_load.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import psutil
import uvloop
from launch import free_port, running

COUNTRIES = ["France", "Germany", "Italy", "Spain", "Japan", "Canada", "Brazil", "Egypt", "Kenya", "Norway",
             "Peru", "Chile", "India", "China", "Mexico", "Greece", "Turkey", "Poland", "Sweden", "Ireland"]
ELEMENTS = ["gold", "silver", "iron", "copper", "oxygen", "hydrogen", "carbon", "sodium", "helium", "neon",
            "zinc", "lead", "tin", "nitrogen", "calcium", "potassium", "sulfur", "argon", "mercury", "uranium"]
BASES = [f"What is the capital of {c}?" for c in COUNTRIES] + \
        [f"What is the chemical symbol for {e}?" for e in ELEMENTS]
PARAPHRASES = (lambda q: q.lower().rstrip("?"),
               lambda q: "Quick question: " + q[0].lower() + q[1:],
               lambda q: q.replace("What is", "What's"))


def workload(n: int, rng: random.Random) -> list[tuple[str, str]]:
    """(intended kind, question): new first-time questions, exact repeats and paraphrases of asked ones."""
    fresh = BASES[:]
    rng.shuffle(fresh)
    asked: list[str] = []
    out = []
    for _ in range(n):
        r = rng.random()
        if not asked or fresh and r < 0.3:
            asked.append(fresh.pop())
            out.append(("new", asked[-1]))
        elif r < 0.75:
            out.append(("repeat", rng.choice(asked)))
        else:
            out.append(("paraphrase", rng.choice(PARAPHRASES)(rng.choice(asked))))
    return out


async def one(http: aiohttp.ClientSession, question: str, max_tokens: int) -> dict:
    """One streamed chat request. Only the first chunk (the `strata` one) is parsed as JSON, later ones are only
    checked for content: all clients share this process's loop, and parsing every chunk delayed the others."""
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.perf_counter()
    ttft = None
    reason = None
    async with http.post("/v1/chat/completions", json=body) as res:
        layer = res.headers.get("x-strata-cache", f"http-{res.status}")
        async for raw in res.content:
            if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                continue
            if reason is None:
                reason = json.loads(raw[6:]).get("strata", {}).get("reason", "")
            elif ttft is None and b'"content":"' in raw and b'"content":""' not in raw:
                ttft = time.perf_counter() - start
    return {"layer": layer, "latency": time.perf_counter() - start, "ttft": ttft}


async def drive(url: str, plan: list[tuple[str, str]], clients: int, max_tokens: int) -> tuple[list[dict], float]:
    queue: asyncio.Queue = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)
    results: list[dict] = []

    async def client() -> None:
        async with aiohttp.ClientSession(url, timeout=aiohttp.ClientTimeout(total=600)) as http:
            while not queue.empty():
                kind, question = queue.get_nowait()
                results.append(await one(http, question, max_tokens) | {"kind": kind, "question": question})

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return results, time.perf_counter() - start


@contextmanager
def strata_serve(args: argparse.Namespace) -> Iterator[tuple[str, psutil.Process]]:
    """`strata serve` on a free loopback port (request cache in args.cache_db: "none" = memory); yields the base URL
    and the server process once healthy."""
    port = free_port()
    cmd = [sys.executable, "-m", "strata.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--cache-db", args.cache_db, "--cache-embedder", args.embedder, "--kv-cache-memory", "256MiB"]
    if args.num_threads:
        cmd += ["--num-threads", str(args.num_threads)]
    cmd += shlex.split(args.serve_args)
    url = f"http://127.0.0.1:{port}"
    with running(cmd, url, timeout=300) as proc:
        yield url, psutil.Process(proc.pid)


def cpu_seconds(server: psutil.Process) -> dict[str, float]:
    """CPU time so far of the HTTP process, the engine process (its child) and this load client."""
    def used(p: psutil.Process) -> float:
        t = p.cpu_times()
        return t.user + t.system
    return {"http": used(server), "engine": sum(used(c) for c in server.children(recursive=True)),
            "client": used(psutil.Process())}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000 if len(values) > 1
                 else values[0] * 1000, 2)


def summarize(results: list[dict], wall: float) -> dict:
    by_layer: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        by_layer[r["layer"]].append(r)
    layers = {}
    for layer, rows in sorted(by_layer.items()):
        lat = [r["latency"] for r in rows]
        ttft = [r["ttft"] for r in rows if r["ttft"] is not None]
        layers[layer] = {"count": len(rows), "share": round(len(rows) / len(results), 3),
                         "p50_ms": pct(lat, 50), "p95_ms": pct(lat, 95), "ttft_p50_ms": pct(ttft, 50)}
    kinds = defaultdict(Counter)
    for r in results:
        kinds[r["kind"]][r["layer"]] += 1
    semantic = [r["latency"] for r in results if r["layer"] in ("semantic", "semantic-similar")]
    return {"requests": len(results), "wall_s": round(wall, 2), "requests_per_s": round(len(results) / wall, 2),
            "layers": layers, "intended_kind_to_layer": {k: dict(v) for k, v in kinds.items()},
            "semantic_any_p50_ms": pct(semantic, 50)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--embedder", default="auto", help="semantic-cache embedder (`strata serve --cache-embedder`)")
    ap.add_argument("--cache-db", default="none", help="request-cache file (`strata serve --cache-db`); none = memory")
    ap.add_argument("--num-threads", type=int, default=None, help="torch threads of the engine (EngineConfig)")
    ap.add_argument("--serve-args", default="", help="more `strata serve` flags, e.g. '--no-access-log'")
    ap.add_argument("--workload-seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--note", default="", help="free text about the machine, stored in the JSON")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    plan = workload(args.requests, random.Random(args.workload_seed))
    warm = [("warm-up", "Say hello."), ("warm-up", "Say hello.")]
    with strata_serve(args) as (url, server):
        uvloop.run(drive(url, warm, 1, args.max_tokens))      # first model step and embedder load, not timed
        before = cpu_seconds(server)
        results, wall = uvloop.run(drive(url, plan, args.clients, args.max_tokens))
        after = cpu_seconds(server)
        # the same hits again, one at a time with the engine idle: the per-hit floor without decode contention
        idle_plan = [(r["kind"], r["question"]) for r in results if r["layer"] in ("exact", "semantic", "miss")]
        idle, idle_wall = uvloop.run(drive(url, idle_plan, 1, args.max_tokens))
    report = {"benchmark": "http_load", "clients": args.clients, "max_tokens": args.max_tokens,
              "engine_threads": args.num_threads, "serve_args": args.serve_args,
              "embedder": args.embedder,
              "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                          "cpus": os.cpu_count(), "note": args.note},
              **summarize(results, wall),
              "cpu_share_while_loaded": {k: round((after[k] - before[k]) / wall, 3) for k in after},
              "idle_engine_hits": summarize(idle, idle_wall)["layers"]}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
