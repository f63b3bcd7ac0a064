"""`strata bench ...`: every benchmark as a command that prints JSON; engine flags are EngineConfig's fields."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import typer

from strata.cache.request.config import RequestCacheConfig
from strata.server.engine.config import EngineConfig
from strata.server.flags import config_command

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print JSON.")


def _write_json(result, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")


def _emit(result, as_json: bool, out: Path | None, plot: Path | None = None, draw=None) -> None:
    """Print the JSON (one line with --json), then write it to `out` and draw(plot): printed first, so a bad path
    loses nothing, and a path that cannot be written is a one-line error."""
    typer.echo(json.dumps(result, indent=None if as_json else 2, ensure_ascii=False))
    if out:
        _save("--out", out, lambda: _write_json(result, out))
    if plot:
        _save("--plot", plot, lambda: draw(result, plot))


def _save(flag: str, path: Path, write) -> None:
    """write() a file named by a flag; a path that cannot be written is a one-line error, not a traceback."""
    try:
        write()
    except OSError as exc:
        _fail(f"{flag} {path}: {exc.strerror or exc}")


def _fail(message: str):
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


@contextlib.contextmanager
def _input_errors_in_one_line():
    """A model, setting or workload the engine refuses (ValueError, a missing file) as one line, not a traceback."""
    try:
        yield
    except (ValueError, OSError) as exc:
        _fail(f"{type(exc).__name__}: {exc}" if isinstance(exc, OSError) else str(exc))


@bench_app.command("throughput")
@config_command(engine=EngineConfig)
def bench_throughput(
    engine: EngineConfig,
    num_requests: int = typer.Option(64, min=1),
    min_prompt: int = typer.Option(16, min=1),
    max_prompt: int = typer.Option(512, min=1),
    min_output: int = typer.Option(16, min=1),
    max_output: int = typer.Option(256, min=1),
    hf_batch_size: int = typer.Option(8, min=1, help="Static batch size of the HF generate baseline."),
    batch1_tokens: int = typer.Option(64, min=1, help="Tokens decoded in the batch-1 comparison."),
    skip_hf: bool = typer.Option(False, help="Only run our engine."),
    workload_seed: int = typer.Option(0, help="Seed of the random prompts and output lengths."),
    as_json: bool = typer.Option(False, "--json"),
    out: Path | None = typer.Option(None, help="Also write the JSON here."),
) -> None:
    """One workload through our engine and through HF generate (static batches), same model and dtype."""
    from strata.server.bench.throughput import run_throughput

    if min_prompt > max_prompt or min_output > max_output:
        _fail("--min-prompt / --min-output must not exceed --max-prompt / --max-output")
    with _input_errors_in_one_line():
        result = run_throughput(engine, num_requests=num_requests, prompt_range=(min_prompt, max_prompt),
                                output_range=(min_output, max_output), hf_batch_size=hf_batch_size,
                                batch1_tokens=batch1_tokens, skip_hf=skip_hf, workload_seed=workload_seed)
    _emit(result, as_json, out)


def _small_pool(engine: EngineConfig, size: str) -> EngineConfig:
    """The bench's own KV pool size unless --kv-cache-memory was set."""
    import dataclasses

    return dataclasses.replace(engine, kv_cache_memory=size) if engine.kv_cache_memory == "auto" else engine


@bench_app.command("kv")
@config_command(engine=EngineConfig)
def bench_kv(
    engine: EngineConfig,
    num_requests: int = typer.Option(24, min=1),
    system_tokens: int = typer.Option(128, min=0, help="Tokens of the system prompt every request shares."),
    min_prompt: int = typer.Option(16, min=1, help="Fewest tokens of a request's own prompt."),
    max_prompt: int = typer.Option(48, min=1),
    output_tokens: int = typer.Option(32, min=1),
    ppl_tokens: int = typer.Option(512, min=2, help="Tokens of the public-domain text scored per (block_size, kv_dtype)."),
    workload_seed: int = typer.Option(0, help="Seed of the random prompts."),
    as_json: bool = typer.Option(False, "--json"),
    plot: Path | None = typer.Option(None, help="Write a PNG of tok/s and KV capacity per setting here."),
    out: Path | None = typer.Option(None, help="Write the rows with their settings and capacity ratios here."),
) -> None:
    """Sweep block size, KV dtype, swap and prefix caching on one small KV pool (default 32MiB) that requests
    oversubscribe."""
    from strata.server.bench.kv import plot_sweep, run_kv_sweep, sweep_report

    if min_prompt > max_prompt:
        _fail("--min-prompt must not exceed --max-prompt")
    load_at_start = os.getloadavg()
    config = _small_pool(engine, "32MiB")
    workload = dict(num_requests=num_requests, system_tokens=system_tokens, unique_range=(min_prompt, max_prompt),
                    output_tokens=output_tokens, ppl_tokens=ppl_tokens, workload_seed=workload_seed)
    with _input_errors_in_one_line():
        rows = run_kv_sweep(config, **workload)
    typer.echo(json.dumps(rows, indent=None if as_json else 2))
    if out:  # the file also keeps the settings and capacity ratios needed to reproduce the rows
        _save("--out", out, lambda: _write_json(sweep_report(rows, config, load_at_start, **workload), out))
    if plot:
        _save("--plot", plot, lambda: plot_sweep(rows, plot))


@bench_app.command("prefix")
@config_command(engine=EngineConfig)
def bench_prefix(
    engine: EngineConfig,
    num_requests: int = typer.Option(16, min=2, help="The first runs alone (it fills the cache); TTFT is the others'."),
    system_tokens: int = typer.Option(1024, min=1, help="Tokens of the system prompt every request shares."),
    workload_seed: int = typer.Option(0, help="Seed of the random prompts."),
    as_json: bool = typer.Option(False, "--json"),
    out: Path | None = typer.Option(None, help="Also write the JSON here."),
) -> None:
    """TTFT with prefix caching on vs off for requests sharing a long system prompt."""
    from strata.server.bench.kv import run_prefix_ttft

    with _input_errors_in_one_line():
        result = run_prefix_ttft(_small_pool(engine, "1GiB"), num_requests=num_requests, system_tokens=system_tokens,
                                 workload_seed=workload_seed)
    _emit(result, as_json, out)


@bench_app.command("int8-accuracy")
@config_command(engine=EngineConfig)
def bench_int8_accuracy(
    engine: EngineConfig,
    max_tokens: int = typer.Option(64, min=1, help="Greedy tokens per prompt."),
    as_json: bool = typer.Option(False, "--json"),
    out: Path | None = typer.Option(None, help="Also write the JSON here."),
) -> None:
    """Perplexity on a public-domain text and greedy agreement over 32 prompts: int8 (and bf16) KV vs fp32 KV."""
    from strata.server.bench.kv import run_int8_accuracy

    with _input_errors_in_one_line():
        result = run_int8_accuracy(_small_pool(engine, "1GiB"), max_tokens=max_tokens)
    _emit(result, as_json, out)


@bench_app.command("spec")
@config_command(engine=EngineConfig)
def bench_spec(
    engine: EngineConfig,
    batch_sizes: str = typer.Option("1,4,16", help="Comma-separated batch sizes."),
    max_tokens: int = typer.Option(96, min=1, help="Greedy tokens per request."),
    num_prompts: int = typer.Option(4, min=1, help="Distinct prompts per workload (a batch repeats them)."),
    repeats: int = typer.Option(2, min=1, help="Runs per side; each side keeps its fastest."),
    workloads: str = typer.Option("", help="Comma-separated workloads to run (default: all)."),
    as_json: bool = typer.Option(False, "--json"),
    plot: Path | None = typer.Option(None, help="Write a PNG of the speedups here."),
    out: Path | None = typer.Option(None, help="Also write the JSON here."),
) -> None:
    """Decode tok/s and inter-token latency with and without speculative drafts (n-gram prompt lookup, cached
    answers), batch 1, 4 and 16; acceptance per source; share of outputs identical to the run without drafts."""
    from strata.server.bench.spec import plot_spec, run_spec_bench
    from strata.server.bench.spec import workloads as known_workloads

    try:
        sizes = tuple(int(b) for b in batch_sizes.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        _fail(f"--batch-sizes takes positive integers separated by commas, got {batch_sizes!r}")
    names = tuple(w for w in workloads.split(",") if w)
    unknown = set(names) - set(known_workloads(1))
    if unknown:
        _fail(f"unknown workload(s) {sorted(unknown)}; known: {', '.join(known_workloads(1))}")
    with _input_errors_in_one_line():
        result = run_spec_bench(_small_pool(engine, "1GiB"), sizes, max_tokens, num_prompts, repeats, names or None)
    _emit(result, as_json, out, plot, plot_spec)


@bench_app.command("weight-accuracy")
@config_command(engine=EngineConfig)
def bench_weight_accuracy(
    engine: EngineConfig,
    max_tokens: int = typer.Option(64, min=1, help="Greedy tokens per prompt."),
    as_json: bool = typer.Option(False, "--json"),
    out: Path | None = typer.Option(None, help="Also write the JSON here."),
) -> None:
    """Perplexity on a public-domain text and greedy agreement over 32 prompts: f16, bf16, int8, int4 and gguf weights vs
    dense fp32 weights."""
    from strata.server.bench.weights import run_weight_accuracy

    with _input_errors_in_one_line():
        result = run_weight_accuracy(_small_pool(engine, "1GiB"), max_tokens=max_tokens)
    _emit(result, as_json, out)


@bench_app.command("cache-quality")
@config_command(prefixed=("cache",), cache=RequestCacheConfig)
def bench_cache_quality(
    cache: RequestCacheConfig,
    pairs: Path | None = typer.Option(None, help="Pairs file: JSONL {cached, query, same, lang}, or a CSV/TSV/JSON "
                                                 "of the shared datasets."),
    bypass: Path | None = typer.Option(None, help="JSONL {query, why}: each asked twice; prints the bypass rate."),
    split: str | None = typer.Option(None, help="Only this split (train, calib, val) of a shared data set's pairs."),
    datasets: Path | None = typer.Option(None, help="The shared data sets, for --split (default: $STRATA_DATASETS, "
                                                    "else ../shared/datasets beside the repository)."),
    full_cache: bool = typer.Option(True, help="Also run the full-cache protocol (every cached question in one "
                                               "cache), besides each pair alone."),
    as_json: bool = typer.Option(False, "--json"),
    out: Path | None = typer.Option(None, help="Also write the JSON here."),
) -> None:
    """Semantic-cache quality: each pair alone (the serve decision: hit rate, precision, false hits, per language
    and tier, and the best any threshold reaches), and the full-cache protocol."""
    from strata.server.bench.cache_quality import run_cache_quality
    from strata.server.tuning.pairs import SPLIT_NAMES

    try:
        if split is not None and split not in SPLIT_NAMES:
            raise ValueError(f"--split takes train, calib or val, got {split!r}")
        result = run_cache_quality(pairs, bypass, cache, split, datasets, full_cache)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        _fail(str(exc))
    _emit(result, as_json, out)
