"""The command line: flags generated from the config dataclasses, --config files, and the defects they replaced."""
import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from strata.cache.request.config import RequestCacheConfig
from strata.server import cli
from strata.server.api import server as api_server
from strata.server.api.config import ServerConfig
from strata.server.engine.config import EngineConfig
from strata.server.flags import flags_of

runner = CliRunner()


@pytest.fixture()
def served(monkeypatch):
    """What `strata serve` would run with: run_server is replaced by a recorder."""
    calls = []
    monkeypatch.setattr(api_server, "run_server", lambda engine, server: calls.append((engine, server)))
    return calls


def serve(served, *args):
    result = runner.invoke(cli.app, ["serve", *args])
    return result, (served[-1] if served else None)


def test_serve_without_flags_uses_the_dataclass_defaults(served):
    result, (engine, server) = serve(served)
    assert result.exit_code == 0, result.output
    assert engine == EngineConfig() and server == ServerConfig()
    assert server.cache.db == ".strata/request_cache.db" and server.max_queue == 256


@pytest.mark.parametrize("args", [["--cache-embedder", "minilm"], ["--semantic-max-error", "0.05"],
                                  ["--no-cache-second-stage"], ["--config", "CACHE_TABLE"]])
def test_one_cache_setting_keeps_the_other_served_defaults(served, tmp_path, args):
    """Audit 14: one cache flag (or a [server.cache] table) built the cache config from the library's defaults, so
    the SQLite file silently became memory: every answer lost at each restart."""
    table = tmp_path / "cache.toml"
    table.write_text("[server.cache]\nsemantic_top_k = 3\n")
    result, (_, server) = serve(served, *[str(table) if a == "CACHE_TABLE" else a for a in args])
    assert result.exit_code == 0, result.output
    assert server.cache.db == ServerConfig().cache.db == ".strata/request_cache.db"


def test_every_config_field_is_a_flag_with_help(served):
    result = runner.invoke(cli.app, ["serve", "--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0
    flags = flags_of("engine", EngineConfig) + flags_of("server", ServerConfig)
    names = {f.option for f in flags}
    assert len(names) == len(flags) == len(dataclasses.fields(EngineConfig)) + len(dataclasses.fields(ServerConfig)) \
        - 1 + len(dataclasses.fields(RequestCacheConfig))
    for flag in flags:
        assert flag.option in result.output, flag.option
        assert flag.help, f"{flag.option} has no help comment"


def test_each_request_cache_setting_reaches_the_server(served):
    result, (_, server) = serve(served, "--cache-db", "none", "--cache-semantic-top-k", "3", "--no-cache-second-stage",
                                "--cache-temperature-rule", "bypass", "--cache-embedder", "none", "--max-queue", "7")
    assert result.exit_code == 0, result.output
    assert server.cache == RequestCacheConfig(db=None, semantic_top_k=3, second_stage=False,
                                              temperature_rule="bypass", embedder="none")
    assert server.max_queue == 7 and not server.cache.semantic


def test_bool_flags_never_read_an_inline_value_as_true(served):
    result, _ = serve(served, "--enforce-eager=false")
    assert result.exit_code == 2 and "does not take a value" in result.output
    assert not served
    _, (engine, _) = serve(served, "--enforce-eager")
    assert engine.enforce_eager
    _, (engine, _) = serve(served, "--no-enforce-eager")
    assert not engine.enforce_eager


def test_invalid_values_are_clear_errors(served):
    result, _ = serve(served, "--block-size", "7")
    assert result.exit_code == 2 and "block_size must be one of" in result.output
    result, _ = serve(served, "--max-model-len", "lots")
    assert result.exit_code == 2 and "--max-model-len" in result.output
    result, _ = serve(served, "--speculative-policy", "sometimes")
    assert result.exit_code == 2 and "speculative_policy must be one of cost, always" in result.output
    result, _ = serve(served, "--engine-nice", "20")
    assert result.exit_code == 2 and "engine_nice must be in 0..19" in result.output


@pytest.mark.parametrize("flag, value, says", [
    ("--kv-dtype", "int4", "unknown kv_dtype 'int4'"),
    ("--load-format", "pt", "unknown load_format 'pt'"),
    ("--attention-backend", "flash", "unknown attention_backend 'flash'"),
    ("--device", "gpu", "unknown device 'gpu'"),
    ("--swap-space", "nan", "swap_space must be a finite number"),
    ("--max-model-len", "-5", "max_model_len must be >= 1"),
    ("--num-threads", "-1", "num_threads must be in 1.."),
    ("--engine-restart-window-s", "nan", "engine_restart_window_s finite and > 0"),
    ("--cache-follow-timeout-s", "-1", "follow_timeout_s must be a finite number of seconds > 0"),
    ("--cache-redis-timeout-s", "nan", "redis_timeout_s must be a finite number of seconds > 0"),
    ("--cache-negative-ttl-s", "inf", "negative_ttl_s must be a finite number of seconds >= 0"),
    ("--cache-default-temperature", "nan", "default_temperature must be in [0, 2]"),
    ("--cache-review-below", "7", "review_below a similarity in [-1, 1]"),
    ("--preemption-mode", "swap", "preemption_mode swap needs --swap-space"),           # silently recomputed
    ("--max-num-seqs", "100000000", "max_num_seqs <= 4096"),
    ("--model-config", "tiny-llama", "names a shape for --load-format dummy"),            # silently ignored
    ("--cache-embedder", "bogus", "embedder 'bogus' is unknown"),                         # served exact-only
])
def test_settings_are_checked_before_the_engine_starts(served, flag, value, says):
    """Refused at the command line with the setting's name, not by a traceback from the engine process."""
    result, _ = serve(served, flag, value)
    assert result.exit_code == 2 and says in " ".join(result.output.replace("│", " ").split()), result.output
    assert not served


def test_config_file_fills_the_same_fields_and_flags_override_it(served, tmp_path):
    path = tmp_path / "strata.toml"
    path.write_text('[engine]\nkv_dtype = "int8"\nblock_size = 32\n'
                    '[server]\nport = 9001\n[server.cache]\nsemantic_top_k = 2\ndb = "x.db"\n')
    result, (engine, server) = serve(served, "--config", str(path), "--block-size", "64")
    assert result.exit_code == 0, result.output
    assert (engine.kv_dtype, engine.block_size) == ("int8", 64)
    assert (server.port, server.cache.semantic_top_k, server.cache.db) == (9001, 2, "x.db")
    assert server.cache.embedder == RequestCacheConfig().embedder
    path.write_text("[engine]\nkv_dtyp = 'int8'\n")
    result, _ = serve(served, "--config", str(path))
    assert result.exit_code == 2 and "kv_dtyp" in result.output


@pytest.mark.parametrize("text, flags, says", [
    ("[server]\nport = 8000.5\n", (), "[server].port must be int"),
    ("[server]\nadmin_token = 12345\n", (), "[server].admin_token must be str"),
    ("[engine]\nenforce_eager = 1\n", (), "[engine].enforce_eager must be bool"),
    ("[server]\ncache = 5\n", ("--cache-db", "none"), "cache must be a table"),
    ("server = 5\n", (), "must be tables"),
])
def test_config_file_values_of_the_wrong_type_are_clear_errors(served, tmp_path, text, flags, says):
    path = tmp_path / "strata.toml"
    path.write_text(text)
    result, _ = serve(served, "--config", str(path), *flags)
    assert result.exit_code == 2 and says in result.output and not served, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_config_file_that_is_not_utf8_is_a_clear_error(served, tmp_path):
    path = tmp_path / "strata.toml"
    path.write_bytes(b"\xff\xfe[engine]\n")
    result, _ = serve(served, "--config", str(path))
    assert result.exit_code == 2 and "cannot read" in result.output


def test_config_file_says_none_as_the_command_line_does(served, tmp_path):
    """TOML has no null: `db = "none"` made a SQLite file named none instead of the in-memory store."""
    path = tmp_path / "strata.toml"
    path.write_text('[engine]\nmax_model_len = "none"\n[server.cache]\ndb = "none"\n')
    result, (engine, server) = serve(served, "--config", str(path))
    assert result.exit_code == 0, result.output
    assert engine.max_model_len is None and server.cache.db is None


def test_config_file_floats_take_ints_and_paths_take_strings(served, tmp_path):
    path = tmp_path / "strata.toml"
    path.write_text("[engine]\nswap_space = 2\n")
    result, (engine, _) = serve(served, "--config", str(path))
    assert result.exit_code == 0, result.output
    assert engine.swap_space == 2.0 and isinstance(engine.swap_space, float)


def test_seeds_have_one_meaning_each():
    """--sampling-seed (generate), --workload-seed (benches), --dummy-weights-seed (EngineConfig, every command)."""
    texts = {name: runner.invoke(cli.app, [*name.split(), "--help"], env={"COLUMNS": "250"}).output
             for name in ("generate", "serve", "bench throughput", "bench kv", "bench prefix")}
    assert "--sampling-seed" in texts["generate"] and "--dummy-weights-seed" in texts["generate"]
    for name in ("bench throughput", "bench kv", "bench prefix"):
        assert "--workload-seed" in texts[name] and "--dummy-weights-seed" in texts[name], name
    assert all(" --seed " not in text for text in texts.values())


def test_cache_quality_bench_takes_the_serve_flags_for_the_cache():
    text = runner.invoke(cli.app, ["bench", "cache-quality", "--help"], env={"COLUMNS": "250"}).output
    assert "--cache-embedder" in text and "--cache-second-stage" in text and "--cache-semantic-top-k" in text
    assert "--verifier" not in text


@pytest.mark.parametrize("args, says", [
    (["throughput", "--num-requests", "0"], "--num-requests"),
    (["throughput", "--min-prompt", "10", "--max-prompt", "4"], "must not exceed"),
    (["kv", "--num-requests", "0"], "--num-requests"),
    (["prefix", "--system-tokens", "-5"], "--system-tokens"),
    (["int8-accuracy", "--max-tokens", "0"], "--max-tokens"),
    (["spec", "--batch-sizes", "0"], "positive integers"),
    (["spec", "--workloads", "bogus"], "unknown workload"),
    (["cache-quality", "--split", "bogus", "--pairs", "x.csv"], "--split takes train, calib or val"),
    (["kv", "--min-prompt", "50", "--max-prompt", "10"], "--min-prompt must not exceed --max-prompt"),
    (["throughput", "--model", "/nonexistent", "--skip-hf"], "FileNotFoundError: model path /nonexistent"),
    (["kv", "--kv-cache-memory", "1e3"], "holds no block"),
    (["prefix", "--num-requests", "1"], "--num-requests"),      # the first runs alone: no TTFT to take the median of
    (["throughput", "--skip-hf", "--max-model-len", "1024", "--max-prompt", "900", "--max-output", "200"],
     "exceed the context of 1024 tokens"),                      # a bare AssertionError once outputs ended early
])
def test_bench_sizes_that_cannot_run_are_refused_before_any_work(args, says):
    result = runner.invoke(cli.app, ["bench", *args])
    assert result.exit_code == 2 and says in result.output, result.output


@pytest.mark.parametrize("args, says", [
    (["--num-threads", "100000"], "num_threads must be in 1.."),                    # segfaulted in OpenMP
    (["--kv-cache-memory", "1e15"], "--kv-cache-memory 1e15 is more than the"),    # allocator traceback
    (["--swap-space", "1000000"], "--swap-space 1000000.0 GiB is more than the"),
    (["--device", "cuda"], "--device cuda: this torch has no CUDA device") if not torch.cuda.is_available() else
    (["--device", "cpu", "--num-threads", "-1"], "num_threads must be in 1.."),
])
def test_engine_settings_this_machine_cannot_honour_are_one_line_errors(tiny_chat_model_dir, args, says):
    result = runner.invoke(cli.app, ["generate", "--model", str(tiny_chat_model_dir), "--dtype", "fp32",
                                     "--prompt", "hi", "--max-tokens", "2", *args], env={"COLUMNS": "250"})
    assert result.exit_code != 0 and says in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("flag", ["--out", "--plot"])
def test_bench_kv_prints_its_rows_first_and_a_path_it_cannot_write_is_one_line(tmp_path, monkeypatch, flag):
    """A bad --out or --plot used to end a finished sweep in a traceback, and --out before its rows were printed."""
    from strata.server.bench import kv

    rows = [{"block_size": 16, "kv_dtype": d, "swap_gib": 0, "prefix_caching": True, "tok_s": 1.0,
             "kv_tokens_capacity": c} for d, c in (("fp32", 100), ("int8", 390))]
    monkeypatch.setattr(kv, "run_kv_sweep", lambda config, **workload: rows)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    result = runner.invoke(cli.app, ["bench", "kv", "--json", flag, str(blocked / "sweep")])
    assert result.exit_code == 2 and f"error: {flag} {blocked / 'sweep'}: " in result.output
    assert "Traceback" not in result.output
    assert json.loads(result.output.splitlines()[0]) == rows
    written = tmp_path / "sweep.json"
    assert runner.invoke(cli.app, ["bench", "kv", "--json", "--out", str(written)]).exit_code == 0
    assert json.loads(written.read_text())["capacity_ratios"] == {"block_16": {"int8_over_fp32": 3.9}}
