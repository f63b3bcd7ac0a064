"""`strata calibrate`: a user's labelled pairs become a calibration file that `strata serve --semantic-calibration`
loads; with --fit-second-stage the adapted cross-encoder travels inside it; a file scored by another second stage
is refused."""
import json

import pytest
from typer.testing import CliRunner

from strata.cache.request.calibration import ScoredPairs
from strata.cache.request.semantic import SemanticCache
from strata.server import cli

runner = CliRunner()
PARAPHRASES = [("How do I reset my password?", "How can I reset my password?"),
               ("Where is my order?", "Where is my package?"),
               ("How do I cancel my subscription?", "How can I cancel my subscription?"),
               ("What are your opening hours?", "When are you open?"),
               ("How do I change my email address?", "How can I update my email address?")]
NEAR_MISSES = [("How do I reset my password?", "How do I reset my API key?"),
               ("How do I cancel my subscription?", "How do I start a subscription?"),
               ("Where is my order?", "Where is my invoice?"),
               ("What are your opening hours?", "What are your delivery fees?"),
               ("How do I change my email address?", "How do I change my shipping address?")]


@pytest.fixture()
def pairs_file(tmp_path):
    rows = [{"cached": f"{hi}{a}", "query": f"{hi}{b}", "same": same} for hi in ("", "Hi, ", "Hello, ", "Please, ")
            for pairs, same in ((PARAPHRASES, True), (NEAR_MISSES, False)) for a, b in pairs]
    path = tmp_path / "support_pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_a_repeated_pair_counts_once(tmp_path, pairs_file):
    """Audit 16: one positive repeated 150 times (a traffic log asks alike, or a file is given twice) certified the
    default bound; copies are not evidence."""
    out = tmp_path / "cal.npz"
    result = runner.invoke(cli.app, ["calibrate", "--pairs", str(pairs_file), "--pairs", str(pairs_file),
                                     "--out", str(out), "--no-second-stage"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output[result.output.index("{"):])["pairs"] == 40 == len(ScoredPairs.load(out).label)


def test_an_unwritable_out_or_an_unknown_embedder_is_refused_before_any_scoring(tmp_path, pairs_file):
    """Audit 16: both surfaced only after the whole scoring pass (hours on a large file), one as a traceback."""
    for args, says in ((["--out", str(pairs_file / "x.npz")], "cannot write there"),
                       (["--out", str(tmp_path / "x.npz"), "--embedder", "e5small"], "unknown embedder")):
        result = runner.invoke(cli.app, ["calibrate", "--pairs", str(pairs_file), *args])
        assert result.exit_code != 0 and says in result.output and "cross-encoder" not in result.output, \
            result.output


def test_a_jsonl_text_may_hold_a_line_separator(tmp_path):
    """U+2028 is valid unescaped inside a JSON string (json.dumps with ensure_ascii=False writes it so)."""
    from strata.server.tuning.pairs import load_pairs

    path = tmp_path / "seps.jsonl"
    path.write_text(json.dumps({"cached": "a\u2028b", "query": "c\u0085d", "same": True}, ensure_ascii=False) + "\n")
    assert [(p.cached, p.query) for p in load_pairs(path)] == [("a\u2028b", "c\u0085d")]


def test_calibrate_writes_a_file_that_serving_loads(tmp_path, pairs_file):
    out = tmp_path / "cal.npz"
    result = runner.invoke(cli.app, ["calibrate", "--pairs", str(pairs_file), "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["pairs"] == 40 and report["tiers"]["e5-small"]["en"]["pairs"] == 40
    scored = ScoredPairs.load(out)
    assert scored.label.sum() == 20 and set(scored.domain) == {"support_pairs"} and scored.adapter is None
    cache = SemanticCache.create("e5-small", calibration=out)
    assert cache.calibration["languages"]["en"]["pairs"] == 40
    assert cache.tiers.zh.off                         # no Chinese pairs: Chinese is not served on this calibration


def test_a_file_scored_without_the_second_stage_is_refused_with_it(tmp_path, pairs_file):
    out = tmp_path / "cosine.npz"
    result = runner.invoke(cli.app, ["calibrate", "--pairs", str(pairs_file), "--out", str(out),
                                     "--no-second-stage"])
    assert result.exit_code == 0, result.output
    SemanticCache.create("e5-small", second_stage=False, calibration=out)
    with pytest.raises(ValueError, match="run `strata calibrate` again"):
        SemanticCache.create("e5-small", second_stage=True, calibration=out)


def test_bad_input_is_a_clear_error(tmp_path):
    result = runner.invoke(cli.app, ["calibrate", "--out", str(tmp_path / "x.npz")])
    assert result.exit_code == 2 and "give --pairs" in result.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"cached": "a"}\n')
    result = runner.invoke(cli.app, ["calibrate", "--pairs", str(bad), "--out", str(tmp_path / "x.npz")])
    assert result.exit_code == 2 and "lacks" in result.output


@pytest.mark.parametrize("name, text, says", [
    ("strings.jsonl", '{"cached": "a", "query": "b", "same": "false"}\n', "'same' must be true or false"),
    ("labels.csv", "sentence1,sentence2,label\na,b,yes\n", "label must be 0 or 1"),
    ("empty_label.tsv", "sentence1\tsentence2\tlabel\na\tb\t\n", "label must be 0 or 1"),
    ("huge.csv", "sentence1,sentence2,label\n" + "x" * 200_000 + ",b,1\n", "line 2"),
    ("long.jsonl", json.dumps({"cached": "x" * 30_000, "query": "b", "same": True}) + "\n", "line 1 is longer"),
])
def test_labels_that_are_not_labels_and_unreadable_rows_are_clear_errors(tmp_path, name, text, says):
    path = tmp_path / name
    path.write_text(text)
    out = tmp_path / "x.npz"
    result = runner.invoke(cli.app, ["calibrate", "--pairs", str(path), "--out", str(out)])
    assert result.exit_code == 2 and says in result.output and not out.exists(), result.output


@pytest.mark.parametrize("args, says", [(["--max-error", "0"], "--max-error must be in (0, 1)"),
                                        (["--max-error", "nan"], "--max-error must be in (0, 1)")])
def test_a_bad_bound_is_refused_before_any_scoring(tmp_path, pairs_file, args, says):
    out = tmp_path / "x.npz"
    result = runner.invoke(cli.app, ["calibrate", "--pairs", str(pairs_file), "--out", str(out), *args])
    assert result.exit_code == 2 and says in result.output and not out.exists()
    result = runner.invoke(cli.app, ["calibrate", "--pairs", str(pairs_file), "--out", str(tmp_path)])
    assert result.exit_code == 2 and "is a directory" in result.output


def test_the_file_is_written_where_the_report_says(tmp_path, pairs_file):
    out = tmp_path / "calibration_without_suffix"
    result = runner.invoke(cli.app, ["calibrate", "--pairs", str(pairs_file), "--out", str(out),
                                     "--no-second-stage"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output[result.output.index("{"):])["written"] == str(out) and out.is_file()
    assert len(ScoredPairs.load(out).label) == 40


@pytest.mark.slow
def test_fit_second_stage_bundles_the_adapted_model(tmp_path, pairs_file):
    out = tmp_path / "fitted.npz"
    result = runner.invoke(cli.app, ["calibrate", "--pairs", str(pairs_file), "--out", str(out),
                                     "--fit-second-stage", str(tmp_path / "fit")])
    assert result.exit_code == 0, result.output
    scored = ScoredPairs.load(out)
    assert scored.adapter is not None and (tmp_path / "fit" / "adapter.npz").exists()
    assert len(scored.label) < 40                     # calibrated on the held-out part only
    cache = SemanticCache.create("e5-small", calibration=out)
    assert cache.scorer.version == scored.meta["second_stage"]


def test_pairs_of_one_kind_say_what_is_missing(tmp_path):
    path = tmp_path / "positives.jsonl"
    path.write_text("\n".join(json.dumps({"cached": a, "query": b, "same": True}) for a, b in PARAPHRASES) + "\n")
    result = runner.invoke(cli.app, ["calibrate", "--pairs", str(path), "--out", str(tmp_path / "x.npz"),
                                     "--no-second-stage"])
    assert result.exit_code == 0 and "needs both same-intent and different-intent pairs" in result.output


def test_a_csv_error_names_the_first_line_of_its_record_and_a_doubled_column_is_refused(tmp_path):
    """Audit 16: a quoted field spanning lines was reported at the record's last line; a second `label` column was
    used silently."""
    from strata.server.tuning.pairs import load_pairs

    path = tmp_path / "p.csv"
    path.write_text('sentence1,sentence2,label\n"a","b",1\n"multi\nline","c",2\n')
    with pytest.raises(ValueError, match="p.csv: line 3: label must be 0 or 1"):
        load_pairs(path)
    path.write_text("sentence1,sentence2,label,label\na,b,1,0\n")
    with pytest.raises(ValueError, match=r"\['label'\] appear twice"):
        load_pairs(path)
