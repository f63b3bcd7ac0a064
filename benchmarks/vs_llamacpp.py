"""Strata and llama.cpp's server side by side on the same model, prompts and greedy settings, back to back.

Builds nothing: pass a `llama-server` binary (see docs/benchmarks.md for the build used) and the GGUF it serves.
Each server runs alone on the machine while it is measured (strata first, then llama.cpp), with 1, 4 and 16
concurrent clients sending raw-text completions (temperature 0, ignore_eos, Strata's response cache bypassed with
`Cache-Control: no-cache, no-store`). Prints JSON: tokens/s per workload and server, their ratio, how far the
two servers' outputs agree (token texts, up to each pair's first difference), and each server's CPU milliseconds per
generated token, per process (on a shared machine the CPU a token costs moves less than the tokens a second do).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/vs_llamacpp.py --llama-server /path/llama-server \
        --gguf /path/SmolLM2-135M-Instruct.F16.gguf --serve-args "--quantization f16" --out result.json

With guidellm installed (`--guidellm-python`, or $PYTHON_GUIDELLM, or in this python), each server also runs stock
guidellm's concurrent profile: synthetic 64-token prompts, 32 output tokens, 4 streams; its output tok/s, TTFT and
inter-token latency go in the JSON beside the clients' figures (guidellm's own reports with --guidellm-reports).

On a CPU with AVX-512, `STRATA_CPU_MARCH=haswell ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` in the environment
makes strata run the code paths of an AVX2-only CPU (pair it with a llama.cpp built without AVX-512).
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil
from guidellm_summary import figures as guidellm_figures
from launch import free_port, running

from strata.models.default_model import default_model_dir
from strata.server.bench.kv import cpu_isa, cpu_name

PROMPTS = json.loads((Path(__file__).parents[1] / "server/bench/data/int8_prompts.json").read_text())["raw"]


def cpu_seconds(pid: int) -> dict[str, float]:
    """User + system CPU seconds of a process and each of its descendants, keyed by role."""
    root = psutil.Process(pid)
    seconds: dict[str, float] = {}
    for proc in (root, *root.children(recursive=True)):
        try:
            times = proc.cpu_times()
            command = " ".join(proc.cmdline())
        except psutil.Error:     # gone between the listing and the read
            continue
        if proc.pid == pid:
            role = "server"
        elif "resource_tracker" in command:
            role = "resource tracker"
        elif "multiprocessing" in command:
            role = "spawned process (the engine)"
        else:
            role = proc.name()
        seconds[role] = seconds.get(role, 0.0) + times.user + times.system
    return seconds


def measured_load(pid: int, url: str, model: str, clients: int, requests: int,
                  max_tokens: int) -> tuple[dict, list[str]]:
    """run_load, with the server's CPU milliseconds per generated token added, per process of its tree."""
    before = cpu_seconds(pid)
    figures, texts = asyncio.run(run_load(url, model, clients, requests, max_tokens))
    after = cpu_seconds(pid)
    tokens = max(figures["completion_tokens"], 1)
    per_process = {role: round(1000 * (spent - before.get(role, 0.0)) / tokens, 3) for role, spent in after.items()}
    figures["cpu_ms_per_token"] = {"total": round(sum(per_process.values()), 3), "per_process": per_process}
    return figures, texts


async def run_load(url: str, model: str, clients: int, requests: int, max_tokens: int) -> tuple[dict, list[str]]:
    """`requests` completions over `clients` concurrent clients; throughput and each prompt's text, in order."""
    texts: list[str | None] = [None] * requests
    generated = 0
    queue = list(range(requests))
    headers = {"Cache-Control": "no-cache, no-store"}

    async def client(http: aiohttp.ClientSession) -> None:
        nonlocal generated
        while queue:
            i = queue.pop(0)
            body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            async with http.post(url + "/v1/completions", json=body, headers=headers) as res:
                data = await res.json()
                if res.status != 200:
                    raise RuntimeError(f"{url} answered {res.status}: {data}")
            texts[i] = data["choices"][0]["text"]
            generated += data["usage"]["completion_tokens"]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        elapsed = time.perf_counter() - start
    return {"clients": clients, "requests": requests, "completion_tokens": generated,
            "tok_s": round(generated / elapsed, 2), "wall_s": round(elapsed, 2)}, texts


def agreement(a: list[str], b: list[str]) -> dict:
    """Share of outputs identical, and the mean length of the common prefix as a share of the longer text."""
    prefix = [next((i for i, (x, y) in enumerate(zip(s, t, strict=False)) if x != y), min(len(s), len(t)))
              / max(len(s), len(t), 1) for s, t in zip(a, b, strict=True)]
    return {"identical_share": round(sum(s == t for s, t in zip(a, b, strict=True)) / len(a), 4),
            "mean_common_prefix_share": round(sum(prefix) / len(prefix), 4)}


def run_guidellm(python: str, url: str, model: str, tokenizer: Path, args: argparse.Namespace, report: Path) -> dict:
    """Stock guidellm's concurrent profile against one server; its figures (guidellm_summary.figures)."""
    backend = {"kind": "openai_http", "target": url, "model": model, "request_format": "/v1/completions",
               "extras": {"headers": {"Cache-Control": "no-cache, no-store"}}}
    cmd = [python, "-m", "guidellm", "run", "--backend", json.dumps(backend),
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
           "--data", f"kind=synthetic_text,prompt_tokens={args.guidellm_prompt_tokens},"
                     f"output_tokens={args.guidellm_output_tokens}",
           "--profile", f"kind=concurrent,streams={args.guidellm_streams}",
           "--constraint", f"kind=max_requests,count={args.guidellm_requests}",
           "--constraint", "kind=max_duration,seconds=600",
           "--output", f"kind=json,path={report}", "--disable-console"]
    # run outside the checkout: `python -m` puts the working folder first on sys.path, and strata's top-level
    # folders (kernels/, models/) would shadow packages of the same names that transformers imports
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tempfile.gettempdir(),
                          env=os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"guidellm failed ({done.returncode}): {(done.stdout + done.stderr)[-3000:]}")
    return guidellm_figures(str(report))


def guidellm_python(explicit: str | None) -> str | None:
    """The python guidellm runs under: --guidellm-python, $PYTHON_GUIDELLM, else this one if it has guidellm."""
    chosen = explicit or os.environ.get("PYTHON_GUIDELLM")
    if chosen:
        return chosen
    return sys.executable if importlib.util.find_spec("guidellm") else None


# Set to run AVX2 code paths on a CPU with more (strata's kernels, torch and oneDNN); recorded with the results
ISA_LIMITS = ("STRATA_CPU_MARCH", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def cpu_flags() -> dict:
    limits = {name: os.environ[name] for name in ISA_LIMITS if name in os.environ}
    return {"model": cpu_name(), "cores": os.cpu_count(), "isa": cpu_isa()} | ({"isa_limits": limits} if limits else {})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-server", required=True, help="path of a llama-server binary")
    ap.add_argument("--gguf", required=True, help="the GGUF llama-server serves (same weights as strata's model)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--serve-args", default="", help="more `strata serve` flags, e.g. '--quantization f16'")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--guidellm-python", default=None,
                    help="python of a venv with guidellm (default: $PYTHON_GUIDELLM, else this python if it has it)")
    ap.add_argument("--guidellm-streams", type=int, default=4)
    ap.add_argument("--guidellm-requests", type=int, default=32)
    ap.add_argument("--guidellm-prompt-tokens", type=int, default=64)
    ap.add_argument("--guidellm-output-tokens", type=int, default=32)
    ap.add_argument("--guidellm-reports", type=Path, default=None,
                    help="folder for guidellm's own JSON reports (default: a temporary folder; the figures are in --out)")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="tokenizer folder guidellm reads (default: the folder strata converts the default model to)")
    args = ap.parse_args()
    model = "SmolLM2-135M-Instruct"
    guidellm = guidellm_python(args.guidellm_python)
    tokenizer = args.tokenizer or default_model_dir()
    if guidellm and not (tokenizer / "tokenizer.json").exists():
        raise SystemExit(f"no tokenizer.json in {tokenizer}: run strata once (it converts the default model) "
                         "or pass --tokenizer")
    result: dict = {"cpu": cpu_flags(), "load_at_start": os.getloadavg(), "settings": vars(args) | {"out": None},
                    "workloads": []}
    reports = args.guidellm_reports or Path(tempfile.mkdtemp(prefix="vs_llamacpp_guidellm_"))
    guidellm_runs: dict[str, dict] = {}
    runs: dict[str, dict[int, tuple[dict, list[str]]]] = {}
    port = free_port()
    strata = [sys.executable, "-m", "strata.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
              "--cache-embedder", "none", "--num-threads", str(args.threads), "--max-num-seqs", "16",
              *shlex.split(args.serve_args)]
    llama = [args.llama_server, "-m", args.gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads),
             "-np", "16", "-c", str(16 * 1024), "--cache-reuse", "0", "--no-webui"]
    for name, cmd, health in (("strata", strata, "/health"), ("llama.cpp", llama, "/health")):
        url = f"http://127.0.0.1:{port}"
        with running(cmd, url, health) as server:
            asyncio.run(run_load(url, model, 1, 1, 4))                  # warm-up
            runs[name] = {c: measured_load(server.pid, url, model, c, c * args.requests_per_client, args.max_tokens)
                          for c in args.clients}
            if guidellm:
                stem = args.out.stem if args.out else "vs_llamacpp"
                report = reports / f"{stem}_guidellm_{name.replace('.', '')}.json"
                guidellm_runs[name] = run_guidellm(guidellm, url, model, tokenizer, args, report)
    for c in args.clients:
        ours, theirs = runs["strata"][c], runs["llama.cpp"][c]
        result["workloads"].append({"clients": c, "strata": ours[0], "llama.cpp": theirs[0],
                                    "ratio_strata_over_llamacpp": round(ours[0]["tok_s"] / theirs[0]["tok_s"], 3),
                                    "cpu_per_token_ratio_llamacpp_over_strata": round(
                                        theirs[0]["cpu_ms_per_token"]["total"] / ours[0]["cpu_ms_per_token"]["total"], 3),
                                    "outputs": agreement(ours[1], theirs[1])})
    if guidellm_runs:
        ours, theirs = guidellm_runs["strata"], guidellm_runs["llama.cpp"]
        result["guidellm"] = {"strata": ours, "llama.cpp": theirs, "ratio_strata_over_llamacpp": round(
            ours["output_tokens_per_s"] / theirs["output_tokens_per_s"], 3)}
    else:
        result["guidellm"] = "not run: guidellm is not installed (--guidellm-python, $PYTHON_GUIDELLM)"
    result["load_at_end"] = os.getloadavg()
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
