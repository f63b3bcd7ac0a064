"""`strata` command line: generate, serve, and the benchmarks.

Engine flags are the fields of EngineConfig spelled as options (`--kv-dtype int8`, `--no-enable-prefix-caching`);
every command that runs an engine accepts them, so they are defined once.
"""

import dataclasses
import json
import sys
import typing
from pathlib import Path

import typer

from strata.server.config import EngineConfig

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Strata: paged-KV LLM server with response caches.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print JSON.")
app.add_typer(bench_app, name="bench")

ENGINE_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}


def _engine_flags_help() -> str:
    names = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(EngineConfig)]
    return "Engine flags (EngineConfig fields): " + ", ".join(names)


def engine_config_from_args(args: list[str], **defaults) -> EngineConfig:
    """Parse `--field value` / `--flag` / `--no-flag` pairs into an EngineConfig, with clear errors."""
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    hints = typing.get_type_hints(EngineConfig)
    values = dict(defaults)
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise typer.BadParameter(f"unexpected argument {arg!r}")
        key, _, inline = arg[2:].partition("=")
        name = key.replace("-", "_")
        negated = name.startswith("no_") and name[3:] in fields
        if negated:
            name = name[3:]
        if name not in fields:
            raise typer.BadParameter(f"unknown option --{key}. {_engine_flags_help()}")
        kind = hints[name]
        if kind is bool:
            values[name] = not negated
            i += 1
            continue
        if inline:
            raw = inline
            i += 1
        elif i + 1 < len(args):
            raw = args[i + 1]
            i += 2
        else:
            raise typer.BadParameter(f"--{key} needs a value")
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        try:
            values[name] = raw if base is str else base(raw)
        except ValueError:
            raise typer.BadParameter(f"--{key} expects {base.__name__}, got {raw!r}") from None
    try:
        return EngineConfig(**values)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _fail(message: str) -> typing.NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


@app.command(context_settings=ENGINE_ARGS, epilog=_engine_flags_help())
def generate(
    ctx: typer.Context,
    prompt: str = typer.Option(..., help="Prompt text."),
    chat: bool = typer.Option(False, help="Wrap the prompt in the model's chat template as a user message."),
    max_tokens: int = typer.Option(64, help="Most new tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0),
    seed: int | None = typer.Option(None, help="Per-request sampling seed (reproducible output)."),
    stop: list[str] = typer.Option([], help="Stop string (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help='Print {"text": ..., "token_ids": [...]}.'),
) -> None:
    """Generate one completion with the engine."""
    from strata.server.llm_engine import LLMEngine, RequestError
    from strata.server.sampling_params import SamplingParams

    config = engine_config_from_args(ctx.args)
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                seed=seed, stop=list(stop))
        engine = LLMEngine(config)
        out = engine.generate([prompt], params, chat=chat)[0]
    except (RequestError, ValueError, FileNotFoundError) as exc:
        _fail(str(exc))
    if as_json:
        typer.echo(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}))
    else:
        typer.echo(out.text)


@app.command(context_settings=ENGINE_ARGS, epilog=_engine_flags_help())
def serve(
    ctx: typer.Context,
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000),
    api_keys: Path | None = typer.Option(None, help="File of '<api-key> <tenant>' lines; without it auth is off."),
    admin_token: str | None = typer.Option(None, envvar="STRATA_ADMIN_TOKEN",
                                           help="Bearer token for /admin/cache/*; without it admin routes are off."),
    max_queue: int = typer.Option(256, help="Requests inside the engine before new misses get 503 + Retry-After."),
    max_body_bytes: int = typer.Option(1 << 20, help="Larger request bodies get 413."),
    default_max_tokens: int = typer.Option(256, help="max_tokens when a request names none."),
    similar_note: bool = typer.Option(True, help="Prefix semantic-similar answers with a visible note."),
    request_cache: bool = typer.Option(True, help="Exact + semantic request caches in front of the engine."),
    cache_db: str = typer.Option(".strata/request_cache.db", help="SQLite file of the request cache ('' = memory)."),
    embedder: str = typer.Option("auto", help="Semantic-cache embedder: auto, e5-small, minilm, use-multilingual, "
                                               "none (exact layer only)."),
    verifier: bool = typer.Option(True, help="Second-stage check of semantic candidates."),
    access_log: bool = typer.Option(True, help="One log line per request (uvicorn's access log; off saves a "
                                                "cache hit ~20% of its CPU)."),
) -> None:
    """Serve the OpenAI-compatible HTTP API (engine + exact and semantic request caches)."""
    from strata.server.api import run_server
    from strata.server.async_engine import EngineStartError
    from strata.server.auth import Auth
    from strata.server.serving import Settings

    try:
        auth = Auth(Auth.read_keys(api_keys) if api_keys else None, admin_token)
    except (OSError, ValueError) as exc:
        _fail(str(exc))
    settings = Settings(max_queue, max_body_bytes, default_max_tokens, similar_note)
    try:
        run_server(engine_config_from_args(ctx.args), host=host, port=port, auth=auth, settings=settings,
                   request_cache=request_cache, cache_db=cache_db or None, embedder=embedder, verifier=verifier,
                   access_log=access_log)
    except EngineStartError as exc:
        _fail(str(exc))


@bench_app.command("throughput", context_settings=ENGINE_ARGS, epilog=_engine_flags_help())
def bench_throughput(
    ctx: typer.Context,
    num_requests: int = typer.Option(64),
    min_prompt: int = typer.Option(16),
    max_prompt: int = typer.Option(512),
    min_output: int = typer.Option(16),
    max_output: int = typer.Option(256),
    hf_batch_size: int = typer.Option(8, help="Static batch size of the HF generate baseline."),
    batch1_tokens: int = typer.Option(64, help="Tokens decoded in the batch-1 comparison."),
    skip_hf: bool = typer.Option(False, help="Only run our engine."),
    seed: int = typer.Option(0),
    as_json: bool = typer.Option(False, "--json"),
    out: Path | None = typer.Option(None, help="Also write the JSON here."),
) -> None:
    """One workload through our engine and through HF generate (static batches), same model and dtype."""
    from strata.server.bench.throughput import run_throughput

    result = run_throughput(engine_config_from_args(ctx.args), num_requests=num_requests,
                            prompt_range=(min_prompt, max_prompt), output_range=(min_output, max_output),
                            hf_batch_size=hf_batch_size, batch1_tokens=batch1_tokens, skip_hf=skip_hf, seed=seed)
    _emit(result, as_json, out)


def _write_json(result, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


def _emit(result, as_json: bool, out: Path | None) -> None:
    """Print the JSON (one line with --json) and also write it to `out`."""
    if out:
        _write_json(result, out)
    typer.echo(json.dumps(result, indent=None if as_json else 2))


@bench_app.command("kv", context_settings=ENGINE_ARGS, epilog=_engine_flags_help())
def bench_kv(
    ctx: typer.Context,
    num_requests: int = typer.Option(24),
    system_tokens: int = typer.Option(128, help="Tokens of the system prompt every request shares."),
    min_prompt: int = typer.Option(16, help="Fewest tokens of a request's own prompt."),
    max_prompt: int = typer.Option(48),
    output_tokens: int = typer.Option(32),
    ppl_tokens: int = typer.Option(512, help="Tokens of the public-domain text scored per (block_size, kv_dtype)."),
    seed: int = typer.Option(0),
    as_json: bool = typer.Option(False, "--json"),
    plot: Path | None = typer.Option(None, help="Write a PNG of tok/s and KV capacity per setting here."),
    out: Path | None = typer.Option(None, help="Write the rows with their settings and capacity ratios here."),
) -> None:
    """Sweep block size, KV dtype, swap and prefix caching on one small KV pool (default 32MiB) that requests
    oversubscribe."""
    import os

    from strata.server.bench.kv import plot_sweep, run_kv_sweep, sweep_report

    load_at_start = os.getloadavg()
    config = engine_config_from_args(ctx.args, kv_cache_memory="32MiB")
    workload = dict(num_requests=num_requests, system_tokens=system_tokens, unique_range=(min_prompt, max_prompt),
                    output_tokens=output_tokens, ppl_tokens=ppl_tokens, seed=seed)
    rows = run_kv_sweep(config, **workload)
    if plot:
        plot_sweep(rows, plot)
    if out:  # the file also keeps the settings and capacity ratios needed to reproduce the rows
        _write_json(sweep_report(rows, config, load_at_start, **workload), out)
    typer.echo(json.dumps(rows, indent=None if as_json else 2))


@bench_app.command("prefix", context_settings=ENGINE_ARGS, epilog=_engine_flags_help())
def bench_prefix(
    ctx: typer.Context,
    num_requests: int = typer.Option(16),
    system_tokens: int = typer.Option(1024, help="Tokens of the system prompt every request shares."),
    seed: int = typer.Option(0),
    as_json: bool = typer.Option(False, "--json"),
    out: Path | None = typer.Option(None, help="Also write the JSON here."),
) -> None:
    """TTFT with prefix caching on vs off for requests sharing a long system prompt."""
    from strata.server.bench.kv import run_prefix_ttft

    config = engine_config_from_args(ctx.args, kv_cache_memory="1GiB")
    _emit(run_prefix_ttft(config, num_requests=num_requests, system_tokens=system_tokens, seed=seed), as_json, out)


@bench_app.command("int8-accuracy", context_settings=ENGINE_ARGS, epilog=_engine_flags_help())
def bench_int8_accuracy(
    ctx: typer.Context,
    max_tokens: int = typer.Option(64, help="Greedy tokens per prompt."),
    as_json: bool = typer.Option(False, "--json"),
    out: Path | None = typer.Option(None, help="Also write the JSON here."),
) -> None:
    """Perplexity on a public-domain text and greedy agreement over 32 prompts: int8 (and bf16) KV vs fp32 KV."""
    from strata.server.bench.kv import run_int8_accuracy

    config = engine_config_from_args(ctx.args, kv_cache_memory="1GiB")
    _emit(run_int8_accuracy(config, max_tokens=max_tokens), as_json, out)


@bench_app.command("cache-quality")
def bench_cache_quality(
    pairs: Path | None = typer.Option(None, help="Pairs file: our JSONL {cached, query, same, lang}, or a CSV/TSV/JSON "
                                             "from ../shared/datasets."),
    bypass: Path | None = typer.Option(None, help="JSONL {query, why}: each asked twice; prints the bypass rate."),
    embedder: str = typer.Option("auto", help="auto (= strata serve's default), e5-small, minilm, use-multilingual."),
    second_stage: bool = typer.Option(True, help="Contrast guard + learned verifier on the top candidates."),
    top_k: int = typer.Option(5),
    as_json: bool = typer.Option(False, "--json"),
    out: Path | None = typer.Option(None, help="Also write the JSON here."),
) -> None:
    """Semantic-cache quality: fill with every cached question, ask every query, report hit rate and precision."""
    from strata.server.bench.cache_quality import run_cache_quality

    try:
        result = run_cache_quality(pairs, bypass, embedder=embedder, second_stage=second_stage, top_k=top_k)
    except (ValueError, FileNotFoundError) as exc:
        _fail(str(exc))
    _emit(result, as_json, out)


def main() -> None:
    app(prog_name="strata")


if __name__ == "__main__":
    sys.exit(main())
