"""`strata` command line: generate, serve, and the benchmarks (`strata bench ...`).

Every configuration field is a flag, generated from the dataclasses (server/flags.py): `--kv-dtype int8`,
`--no-enable-prefix-caching`, `--cache-db FILE`; `--config FILE` (TOML) sets the same fields, flags override it.
"""

import json
import sys
import typing
from pathlib import Path

import typer

from strata.server.api.config import ServerConfig
from strata.server.bench.commands import bench_app
from strata.server.engine.config import EngineConfig
from strata.server.flags import config_command

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Strata: paged-KV LLM server with response caches.")
app.add_typer(bench_app, name="bench")


def _fail(message: str) -> typing.NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


@app.command()
@config_command(engine=EngineConfig)
def generate(
    engine: EngineConfig,
    prompt: str = typer.Option(..., help="Prompt text."),
    chat: bool = typer.Option(False, help="Wrap the prompt in the model's chat template as a user message."),
    max_tokens: int = typer.Option(64, help="Most new tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0),
    sampling_seed: int | None = typer.Option(None, help="Per-request sampling seed (reproducible output)."),
    stop: list[str] = typer.Option([], help="Stop string (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help='Print {"text": ..., "token_ids": [...]}.'),
) -> None:
    """Generate one completion with the engine."""
    from strata.server.engine.engine_process import configure_logging
    from strata.server.engine.llm_engine import LLMEngine, RequestError
    from strata.server.engine.sampling_params import SamplingParams

    configure_logging()
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                seed=sampling_seed, stop=list(stop))
        out = LLMEngine(engine).generate([prompt], params, chat=chat)[0]
    except (RequestError, ValueError, FileNotFoundError) as exc:
        _fail(str(exc))
    if as_json:
        typer.echo(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}))
    else:
        typer.echo(out.text)


@app.command()
@config_command(engine=EngineConfig, server=ServerConfig)
def serve(engine: EngineConfig, server: ServerConfig) -> None:
    """Serve the OpenAI-compatible HTTP API (engine + exact and semantic request caches)."""
    from strata.server.api.server import EngineFailed, run_server
    from strata.server.engine.engine_client import EngineStartError

    try:
        run_server(engine, server)
    except EngineFailed as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except (EngineStartError, OSError, ValueError) as exc:
        _fail(str(exc))


@app.command()
def calibrate(
    pairs: list[Path] = typer.Option([], help="Labelled pairs (JSONL {cached, query, same}, CSV/TSV sentence1, "
                                              "sentence2, label, or JSON [{origin, similar}]); repeatable."),
    shared_split: str | None = typer.Option(None, help="Instead: this split (train, calib, val) of the shared data "
                                                       "sets (what the shipped calibration file is made of)."),
    datasets: Path | None = typer.Option(None, help="The shared data sets (default: $STRATA_DATASETS, else "
                                                    "../shared/datasets beside the repository)."),
    embedders: list[str] = typer.Option(["auto"], "--embedder", help="Embedder(s) whose cosines to record."),
    second_stage: bool = typer.Option(True, help="Score with the cross-encoder (off: tiers on cosine alone)."),
    max_error: float = typer.Option(0.02, help="Bound to report the certified tiers for (serving picks its own)."),
    fit_second_stage: Path | None = typer.Option(None, help="First adapt the cross-encoder to --pairs: train on their "
                                                            "train split (checkpoints in this folder), calibrate on the "
                                                            "held-out rest, and bundle it in --out."),
    out: Path = typer.Option(..., help="Calibration file to write; `strata serve --semantic-calibration FILE`."),
) -> None:
    """Score labelled pairs as the semantic layer sees them and write a calibration file; print the tiers it
    certifies at --max-error for each embedder."""
    from strata.cache.request.calibration import fit_tiers
    from strata.cache.request.cross_encoder import shared_cross_encoder
    from strata.cache.request.embedders import embedder_key
    from strata.server.bench.data_files import datasets_dir
    from strata.server.tuning.calibrate import score_pairs, writable_out, write
    from strata.server.tuning.pairs import SPLIT_NAMES, distinct_pairs, load_pairs
    from strata.server.tuning.pairs import shared_split as load_split

    try:
        if not 0 < max_error < 1:                  # before hours of scoring, not after
            raise ValueError(f"--max-error must be in (0, 1), got {max_error}")
        if out.is_dir():
            raise ValueError(f"--out {out} is a directory: name the calibration file to write")
        writable_out(out)                           # and every --embedder named: before hours of scoring, not after
        for name in embedders:
            embedder_key(name)
        if shared_split is not None:
            if shared_split not in SPLIT_NAMES or pairs:
                raise ValueError("--shared-split takes train, calib or val, and no --pairs")
            rows, source = load_split(datasets_dir(datasets), shared_split), f"shared data sets, {shared_split} split"
        elif pairs:
            rows = distinct_pairs([p for path in pairs for p in load_pairs(path)])
            source = ", ".join(p.name for p in pairs)
        else:
            raise ValueError("give --pairs FILE (repeatable) or --shared-split SPLIT")
        cross_encoder, bundled = shared_cross_encoder() if second_stage else None, None
        if fit_second_stage is not None:
            if shared_split is not None or not second_stage:
                raise ValueError("--fit-second-stage takes --pairs and needs the second stage")
            from strata.cache.request.cross_encoder import CrossEncoder, read_adapter
            from strata.server.tuning.fit import fit_second_stage as fit
            from strata.server.tuning.fit import split_for_fit

            bundled = read_adapter(fit(rows, fit_second_stage))
            rows = split_for_fit(rows)[1]                    # calibrate only on pairs the fitted model never saw
            cross_encoder = CrossEncoder(bundled)
            source += ", second stage fitted to them"
        scored = score_pairs(rows, embedders, cross_encoder, source, bundled)
        write(scored, out)
        report = {name: fit_tiers(scored, name, second_stage, max_error)[1] for name in scored.cosine}
    except (ValueError, OSError, KeyError) as exc:
        _fail(str(exc))
    typer.echo(json.dumps({"written": str(out), "pairs": len(rows), "max_error": max_error, "tiers": report},
                          indent=2, ensure_ascii=False))


def main() -> None:
    app(prog_name="strata")


if __name__ == "__main__":
    sys.exit(main())
