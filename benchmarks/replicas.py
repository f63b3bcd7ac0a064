"""Replicas sharing one Redis (--cache-redis): hit latency per layer in-process, then a two-replica load run across a
Redis kill and restart.

Part 1 (in-process, loopback Redis, exact layer + the hash test embedder so the cache path is timed, not a model):
  today_memory_hit   RequestCache on SQLite: an exact hit from its in-process LRU (what main serves today)
  l1_hit             RequestCache on Redis: an exact hit from its in-process W-TinyLFU
  redis_exact_hit    replica B, an answer written by A, B's L1 emptied: one script call to Redis (policy and
                     templating memos warm, as in the two rows above; *_cold_rules: the first read, memos cold)
  semantic_synced    replica B, a paraphrase of A's question: B's local index (fed by the stream), entry from Redis
  sync_delay         A's write -> in B's index (stream delivery)
  outage_l1_hit, outage_miss   Redis killed: an L1 hit, and a miss (breaker open: no network wait)
  The peers (today vs L1) run in the same process, call by call interleaved, with the same semantic layer: on a
  shared, busy host compare their ratio (l1_over_today_p50), not absolute figures.
Part 2 (--load-seconds, default 120): two `strata serve --cache-redis` replicas (the default model), clients on both;
  Redis (append-only file, fsync always) SIGKILLed at 1/3 and restarted at 2/3 of the run. Counts 5xx, and checks that every answer a replica
  acknowledged as computed (a miss) is, after the restart, served from the cache by the other replica.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/replicas.py --out benchmarks/results/replicas/replicas.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from launch import wait_healthy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # the tests' redis-server launcher
from helpers.redis_server import RedisServer, free_port  # noqa: E402

from strata.cache.request.calibration import Tiers  # noqa: E402
from strata.cache.request.embedders import HashEmbedder  # noqa: E402
from strata.cache.request.keys import build_key  # noqa: E402
from strata.cache.request.request_cache import CacheRequest, RequestCache, RequestCacheConfig  # noqa: E402
from strata.cache.request.semantic import SemanticCache  # noqa: E402

ADMIN = "bench-admin"       # the load run's replicas: /admin/cache/stats after the run
ANSWER = "Paris is the capital of France. " * 20         # ~640 characters, as benchmarks/request_cache_latency.py


def chat(text: str, tenant: str = "default") -> CacheRequest:
    return CacheRequest(tenant, "SmolLM2-135M-Instruct@bench", [{"role": "user", "content": text}], {"temperature": 0})


def summary(samples_s: list[float]) -> dict:
    ms = sorted(s * 1000 for s in samples_s)
    pick = lambda q: round(ms[min(len(ms) - 1, int(q * len(ms)))], 4)      # noqa: E731
    return {"n": len(ms), "p50_ms": pick(0.5), "p95_ms": pick(0.95), "p99_ms": pick(0.99)}


async def timed(calls) -> tuple[list[float], list]:
    out, results = [], []
    for make in calls:
        t0 = time.perf_counter()
        results.append(await make())
        out.append(time.perf_counter() - t0)
    return out, results


def hash_semantic() -> SemanticCache:
    return SemanticCache(HashEmbedder(), Tiers(serve=0.95, similar=0.85))


async def in_process(n: int) -> dict:
    rng = random.Random(0)
    token = lambda: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(10))     # noqa: E731
    # distinct random words: no two questions are near each other for the hash embedder, a paraphrase is
    questions = [f"Explain {token()} versus {token()} for {token()} in detail." for _ in range(n)]
    paraphrase = lambda q: q.replace(" in detail.", " in more detail.")      # noqa: E731
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        today = RequestCache(RequestCacheConfig(db=os.path.join(tmp, "today.db"), embedder="hash"),
                             semantic=hash_semantic())
        for q in questions:
            (await today.lookup(chat(q))).complete(ANSWER)
        await today.drain()
        redis_server = RedisServer().start()
        config = RequestCacheConfig(redis=redis_server.url(), embedder="hash")
        a = RequestCache(config, semantic=hash_semantic())
        b = RequestCache(config, semantic=hash_semantic())
        try:
            sync = []
            for q in questions:
                lookup = await a.lookup(chat(q))
                assert lookup.layer == "miss", lookup.layer
                lookup.complete(ANSWER)
                await a.drain()
                t0 = time.perf_counter()
                while len(b.semantic) < len(a.semantic):
                    await asyncio.sleep(0.0005)
                sync.append(time.perf_counter() - t0)
            t_today, t_l1 = [], []
            for q in questions * 10:        # interleaved, call by call: both peers see the same host load
                for peer, out in ((today, t_today), (a, t_l1)):
                    t0 = time.perf_counter()
                    got = await peer.lookup(chat(q))
                    out.append(time.perf_counter() - t0)
                    assert got.layer == "exact", got.layer
            results["today_memory_hit"] = summary(t_today)
            results["l1_hit"] = summary(t_l1)
            results["l1_over_today_p50"] = round(results["l1_hit"]["p50_ms"] / results["today_memory_hit"]["p50_ms"], 3)
            t_semantic, got = await timed([lambda q=q: b.lookup(chat(paraphrase(q))) for q in questions])
            results["semantic_synced"] = summary(t_semantic) | {
                "hits": sum(g.layer.startswith("semantic") for g in got)}
            for label in ("redis_exact_hit_cold_rules", "redis_exact_hit"):     # first read: policy memos cold
                b.exact.memory.clear()                                          # so every lookup goes to Redis
                t_redis, got = await timed([lambda q=q: b.lookup(chat(q)) for q in questions])
                assert all(g.layer == "exact" for g in got), {g.layer for g in got}
                results[label] = summary(t_redis)
            results["sync_delay"] = summary(sync)
            redis_server.kill()
            for _ in range(5):          # the breaker opens after a few failed calls
                (await a.lookup(chat("Is anyone there?"))).release()
            t_out_hit, got = await timed([lambda q=q: a.lookup(chat(q)) for q in questions])
            assert all(g.layer == "exact" for g in got)
            results["outage_l1_hit"] = summary(t_out_hit)

            async def miss(i: int):
                lookup = await a.lookup(chat(f"A question nobody asked before, number {i}?"))
                lookup.release()
                return lookup

            t_out_miss, got = await timed([lambda i=i: miss(i) for i in range(n)])
            results["outage_miss"] = summary(t_out_miss) | {"layers": sorted({g.layer for g in got})}
            results["outage_link"] = a.stats()["redis"]
        finally:
            a.close()
            b.close()
            today.close()
            redis_server.kill()
    return results


def serve(url: str, port: int, extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "strata.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--cache-redis", url, "--cache-embedder", "hash", "--kv-cache-memory", "256MiB", "--num-threads", "1",
           "--admin-token", ADMIN,
           *shlex.split(extra)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


async def load_run(seconds: float, clients: int, extra: str) -> dict:
    # a durable Redis (append-only file, fsync per write), as in production: what it acknowledged survives the kill,
    # and what the replicas queued meanwhile must reach it after the restart
    data = tempfile.mkdtemp(prefix="strata-redis-")
    redis_server = RedisServer("--appendonly", "yes", "--appendfsync", "always", "--dir", data).start()
    ports = [free_port(), free_port()]
    bases = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [serve(redis_server.url(), p, extra) for p in ports]
    try:
        for base in bases:
            wait_healthy(base)
        rng = random.Random(0)
        word = lambda: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(9))    # noqa: E731
        acknowledged: dict[str, int] = {}      # question -> replica that computed it (a miss, answered 200)
        asked: list[str] = []
        log: list[dict] = []
        start = time.monotonic()
        events = {}

        async def client(http: httpx.AsyncClient, replica: int, n: int) -> None:
            count = 0
            while time.monotonic() - start < seconds:
                count += 1
                new = not asked or rng.random() < 0.5
                # new questions share no words: near-identical ones from one client would trip the penetration guard
                question = f"Compare {word()} with {word()} and {word()}." if new else rng.choice(asked)
                t0 = time.monotonic()
                try:
                    res = await http.post(bases[replica] + "/v1/chat/completions", json={
                        "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": question}],
                        "max_tokens": 8, "temperature": 0})
                    status, layer = res.status_code, res.headers.get("x-strata-cache")
                except httpx.HTTPError as exc:
                    status, layer = 0, f"transport: {exc}"
                log.append({"t": round(t0 - start, 3), "replica": replica, "status": status, "layer": layer,
                            "latency_s": round(time.monotonic() - t0, 4)})
                if status == 200 and layer == "miss":
                    acknowledged.setdefault(question, replica)
                    asked.append(question)

        async def drill() -> None:
            await asyncio.sleep(seconds / 3)
            redis_server.kill()
            events["redis_killed_at_s"] = round(time.monotonic() - start, 2)
            await asyncio.sleep(seconds / 3)
            redis_server.start()
            events["redis_restarted_at_s"] = round(time.monotonic() - start, 2)

        async with httpx.AsyncClient(timeout=120) as http:
            await asyncio.gather(drill(), *[client(http, r, n) for r in (0, 1) for n in range(clients)])
        # both replicas back in sync, their outage queues flushed
        deadline = time.monotonic() + 60
        while not all(metric(b, "strata_cache_redis_up") == 1 and metric(b, "strata_cache_redis_queue_depth") == 0
                      for b in bases):
            assert time.monotonic() < deadline, "replicas did not resync within 60 s"
            await asyncio.sleep(0.5)
        dropped = [metric(b, "strata_cache_redis_queue_dropped_total") for b in bases]
        stats = [httpx.get(b + "/admin/cache/stats", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
                 .json()["request_cache"]["counters"] for b in bases]
        skipped = sum(n for s in stats for k, n in s.get("write", {}).items() if k.startswith("skipped"))
        client = redis_server.client()
        keys = list(client.scan_iter(match="strata:*:e:*", count=1000))
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.hget(key, "text")
        stored = {t.decode() for t in pipe.execute() if t is not None}
        lost = [q for q in acknowledged if build_key(chat(q)).text not in stored]   # the key text the cache stores
        phases = {"before": (0, events["redis_killed_at_s"]),
                  "outage": (events["redis_killed_at_s"], events["redis_restarted_at_s"]),
                  "after": (events["redis_restarted_at_s"], seconds + 1000)}
        by_phase = {}
        for phase, (lo, hi) in phases.items():
            rows = [r for r in log if lo <= r["t"] < hi]
            by_phase[phase] = {"requests": len(rows), "5xx": sum(r["status"] >= 500 for r in rows),
                               "other_errors": sum(r["status"] != 200 and r["status"] < 500 for r in rows),
                               "latency": summary([r["latency_s"] for r in rows]) if rows else None,
                               "layers": {k: sum(r["layer"] == k for r in rows) for k in {r["layer"] for r in rows}}}
        return {"seconds": seconds, "clients_per_replica": clients, **events, "requests": len(log),
                "5xx": sum(r["status"] >= 500 for r in log), "non_200": sum(r["status"] != 200 for r in log),
                "acknowledged_writes": len(acknowledged), "lost_acknowledged_writes": len(lost),
                "lost_examples": lost[:5], "writes_skipped_by_policy": skipped, "queue_dropped": dropped,
                "phases": by_phase, "write_counters": [s.get("write", {}) for s in stats],
                "lease_counters": [s.get("lease", {}) for s in stats],
                "guard_counters": [s.get("guard", {}) for s in stats]}
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)
        redis_server.kill()
        shutil.rmtree(data, ignore_errors=True)


def machine() -> dict:
    info = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return {"cpu": model, "cpus": os.cpu_count(), "cpu_flags": sorted(f for f in flags if f.startswith(("avx", "amx"))),
            "platform": platform.platform(), "python": platform.python_version(),
            "redis": subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()[2],
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1000, help="questions in part 1")
    parser.add_argument("--load-seconds", type=float, default=120, help="part 2's run; 0 skips it")
    parser.add_argument("--clients", type=int, default=3, help="part 2: concurrent clients per replica")
    parser.add_argument("--serve-args", default="", help="more `strata serve` flags for part 2")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = {"benchmark": "replicas", "in_process": asyncio.run(in_process(args.n))}
    if args.load_seconds:
        report["load_run"] = asyncio.run(load_run(args.load_seconds, args.clients, args.serve_args))
    report["machine"] = machine()
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
