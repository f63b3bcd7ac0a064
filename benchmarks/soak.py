"""Soak: 64 concurrent streaming clients for 10 minutes against `strata serve`, mixing new questions (misses),
exact repeats and paraphrases; reports errors, p50/p99 latency per cache layer, and RSS of the HTTP and engine
processes over time (JSON + PNG). Not in CI: it is the long-run check that nothing leaks and nothing fails.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/soak.py --duration 600 --clients 64 \\
        --out benchmarks/results/soak.json --plot benchmarks/results/soak.png
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil
import uvloop
from http_load import BASES, PARAPHRASES, pct, strata_serve

TOPICS = ["rivers", "bridges", "volcanoes", "owls", "trains", "glaciers", "deserts", "comets", "bees", "castles"]


class Mix:
    """Questions for the next request: a new one (a miss), an exact repeat, or a paraphrase of an asked one."""

    def __init__(self, rng: random.Random):
        self.rng, self.asked, self.count = rng, list(BASES[:5]), 0

    def next(self) -> str:
        r = self.rng.random()
        if r < 0.3:
            self.count += 1
            question = f"Give one fact about {self.rng.choice(TOPICS)}, fact number {self.count}."
            self.asked.append(question)
            return question
        if r < 0.8:
            return self.rng.choice(self.asked)
        return self.rng.choice(PARAPHRASES)(self.rng.choice(self.asked))


async def one(http: aiohttp.ClientSession, question: str, max_tokens: int) -> dict:
    """One streamed request: its layer, latency to the last byte, and whether it failed (status or in-band)."""
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.perf_counter()
    try:
        async with http.post("/v1/chat/completions", json=body) as res:
            layer = res.headers.get("x-strata-cache", "none")
            error = None if res.status == 200 else f"HTTP {res.status}"
            async for raw in res.content:
                if raw.startswith(b'data: {"error"'):
                    error = raw[6:200].decode(errors="replace")
    except (TimeoutError, aiohttp.ClientError) as exc:
        layer, error = "none", f"{type(exc).__name__}: {exc}"
    return {"layer": layer, "latency": time.perf_counter() - start, "error": error, "at": time.monotonic()}


async def soak(url: str, server: psutil.Process, args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    mix, results, samples = Mix(random.Random(args.workload_seed)), [], []
    started = time.monotonic()
    end = started + args.duration

    async def client() -> None:
        async with aiohttp.ClientSession(url, timeout=aiohttp.ClientTimeout(total=600)) as http:
            while time.monotonic() < end:
                results.append(await one(http, mix.next(), args.max_tokens))

    async def sampler() -> None:
        while time.monotonic() < end:
            engine = sum(c.memory_info().rss for c in server.children(recursive=True))
            samples.append({"t_s": round(time.monotonic() - started, 1), "http_rss_mib": server.memory_info().rss / 2**20,
                            "engine_rss_mib": engine / 2**20, "requests": len(results),
                            "errors": sum(r["error"] is not None for r in results)})
            await asyncio.sleep(args.sample_s)

    await asyncio.gather(sampler(), *(client() for _ in range(args.clients)))
    return results, samples


def growth(samples: list[dict], key: str, warm_up_s: float) -> float:
    """Relative RSS growth from the end of warm-up to the end of the run."""
    after = [s for s in samples if s["t_s"] >= warm_up_s] or samples
    return round((after[-1][key] - after[0][key]) / after[0][key], 4)


def plot(samples: list[dict], results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] for s in samples]
    fig, (mem, lat) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    mem.plot(t, [s["http_rss_mib"] for s in samples], label="HTTP process")
    mem.plot(t, [s["engine_rss_mib"] for s in samples], label="engine process")
    mem.set_ylabel("RSS (MiB)")
    mem.legend()
    start = min(r["at"] for r in results)
    for layer in sorted({r["layer"] for r in results}):
        rows = [r for r in results if r["layer"] == layer]
        lat.scatter([r["at"] - start for r in rows], [r["latency"] * 1000 for r in rows], s=3, label=layer)
    lat.set_yscale("log")
    lat.set_ylabel("latency to last byte (ms)")
    lat.set_xlabel("seconds")
    lat.legend(markerscale=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--warm-up-s", type=float, default=60.0, help="RSS growth is measured from here on")
    ap.add_argument("--embedder", default="auto")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--serve-args", default="")
    ap.add_argument("--workload-seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        args.cache_db = str(Path(tmp) / "soak.db")          # the SQLite store is part of what soaks
        with strata_serve(args) as (url, server):
            results, samples = uvloop.run(soak(url, server, args))
    errors = [r for r in results if r["error"] is not None]
    layers = {}
    for layer in sorted({r["layer"] for r in results}):
        lat = [r["latency"] for r in results if r["layer"] == layer]
        layers[layer] = {"count": len(lat), "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99)}
    report = {"benchmark": "soak", "duration_s": args.duration, "clients": args.clients, "max_tokens": args.max_tokens,
              "requests": len(results), "errors": len(errors), "error_examples": [e["error"] for e in errors[:5]],
              "layers": layers,
              "rss_growth_after_warm_up": {"http": growth(samples, "http_rss_mib", args.warm_up_s),
                                           "engine": growth(samples, "engine_rss_mib", args.warm_up_s)},
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "cpu_flags": sorted({f for f in open("/proc/cpuinfo").read().split()
                                               if f.startswith(("avx", "amx"))})},
              "samples": samples}
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(samples, results, args.plot)


if __name__ == "__main__":
    main()
