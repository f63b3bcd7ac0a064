"""`strata` command line: generate, serve, and the benchmarks (`strata bench ...`).

Every configuration field is a flag, generated from the dataclasses (server/flags.py): `--kv-dtype int8`,
`--no-enable-prefix-caching`, `--cache-db FILE`; `--config FILE` (TOML) sets the same fields, flags override it.
"""

import json
import sys
import typing

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
    from strata.server.engine.llm_engine import LLMEngine, RequestError
    from strata.server.engine.sampling_params import SamplingParams

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


def main() -> None:
    app(prog_name="strata")


if __name__ == "__main__":
    sys.exit(main())
