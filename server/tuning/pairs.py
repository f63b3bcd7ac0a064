"""Labelled question pairs (the shared data sets, or a user's file), and the leak-free train / calib / val split that
training, calibration and the quality bench all use.

The split is by connected component: sentences are nodes (after light normalisation), pairs are edges, and a whole
component goes to one split, chosen by a hash of its smallest member. So no sentence (up to case, width, spacing and
punctuation) is in two splits, the assignment needs no random state, and it does not move when files are added.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from strata.cache.request.calibration import language_of

log = logging.getLogger(__name__)

# The shared labelled pair files (en_contextual_queries.json is multi-turn and is checked elsewhere).
SHARED_FILES = (
    "zh_lcqmc_dev.tsv", "zh_bq_dev.tsv", "zh_afqmc_train.tsv", "zh_pawsx_dev.tsv", "zh_faq_pairs.jsonl",
    "en_mrpc_train.tsv", "en_hard_pairs.csv", "en_paraphrases_gptcache.json",
)
MAX_PAIR_CHARS = 20_000     # both texts of a pair together (the shared sets' longest is 1,906)
SPLITS = (("train", 0.6), ("calib", 0.8), ("val", 1.0))      # cumulative upper bounds of the component hash
SPLIT_NAMES = tuple(name for name, _ in SPLITS)


@dataclass(frozen=True, slots=True)
class Pair:
    """One labelled pair: the cached question, the new one, whether they ask the same, its language and source."""

    cached: str
    query: str
    same: bool
    lang: str           # "zh" | "en", by the query (the rule the cache picks tiers by)
    domain: str         # short source name, e.g. "lcqmc"


def domain_of(path: Path | str) -> str:
    """zh_lcqmc_dev.tsv -> lcqmc, en_hard_pairs.csv -> hard_pairs, my_pairs.jsonl -> my_pairs."""
    return re.sub(r"^(zh|en)_|_(dev|train|test)$", "", Path(path).name.split(".")[0])


def distinct_pairs(pairs: list[Pair]) -> list[Pair]:
    """Each (cached, query, label) once: a repeated pair (a traffic log asks the same twice, or one file is given
    twice) is not more evidence, and counted as such it certified bounds that the data did not support."""
    return list({(p.cached, p.query, p.same): p for p in pairs}.values())


def load_pairs(path: Path | str) -> list[Pair]:
    """Read JSONL {cached, query, same}, CSV/TSV with sentence1, sentence2, label (other columns ignored), or a JSON
    list of {origin, similar} (positives only); clear errors naming the file and line for anything else. Pairs with an
    empty side are left out, and a warning counts them."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"pairs file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        raw = [_jsonl_pair(path, number, row) for number, row in jsonl_rows(path)]
    elif suffix in (".csv", ".tsv"):
        raw = _table_pairs(path, suffix)
    elif suffix == ".json":
        try:
            rows = json.loads(_text(path))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc.msg}, line {exc.lineno} column {exc.colno})") from None
        if not isinstance(rows, list) or not all(isinstance(r, dict) and {"origin", "similar"} <= r.keys() for r in rows):
            raise ValueError(f"{path}: expected a JSON list of {{origin, similar}}")
        raw = [(f"item {i}", r["origin"], r["similar"], True) for i, r in enumerate(rows, 1)]
    else:
        raise ValueError(f"{path}: unknown pairs format {suffix!r} (use .jsonl, .csv, .tsv or .json)")
    for where, a, b, _ in raw:
        if not isinstance(a, str) or not isinstance(b, str):
            raise ValueError(f"{path}: {where}: both questions must be text, got {type(a).__name__} and "
                             f"{type(b).__name__}")
        if len(a) + len(b) > MAX_PAIR_CHARS:
            raise ValueError(f"{path}: {where} is longer than {MAX_PAIR_CHARS} characters: questions, not "
                             "documents (each is embedded and read by the cross-encoder)")
    domain = domain_of(path)
    pairs = [Pair(a.strip(), b.strip(), same, language_of(b), domain) for _, a, b, same in raw if a.strip() and b.strip()]
    if len(pairs) < len(raw):
        log.warning("%s: %d of %d pairs left out: a question is empty", path, len(raw) - len(pairs), len(raw))
    if not pairs:
        raise ValueError(f"{path}: no pairs")
    return pairs


def _text(path: Path) -> str:
    """The file as UTF-8 (a byte-order mark, as spreadsheets write, dropped)."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise ValueError(f"{path}: line {line}: not UTF-8 text ({exc.reason})") from None


def jsonl_rows(path: Path) -> list[tuple[int, object]]:
    """(line number, parsed value) of each non-blank line of a JSONL file; ValueError naming the file and line for
    text that is not UTF-8 or a line that is not JSON."""
    rows = []
    # "\n" only: str.splitlines also breaks at U+2028 / U+0085, which JSON strings may hold unescaped
    for number, line in enumerate(_text(Path(path)).split("\n"), 1):
        if line.strip():
            try:
                rows.append((number, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: line {number}: not JSON ({exc.msg}, column {exc.colno})") from None
    return rows


def _jsonl_pair(path: Path, number: int, row: object) -> tuple[str, object, object, bool]:
    if not isinstance(row, dict) or not {"cached", "query", "same"} <= row.keys():
        raise ValueError(f"{path}: line {number} lacks one of cached/query/same")
    if not isinstance(row["same"], bool):
        raise ValueError(f"{path}: line {number}: 'same' must be true or false, got {row['same']!r}")
    return f"line {number}", row["cached"], row["query"], row["same"]


def _table_pairs(path: Path, suffix: str) -> list[tuple[str, object, object, bool]]:
    lines = io.StringIO(_text(path), newline="")
    # no quoting in TSV: its sentences hold stray quote characters that must not open a field
    reader = csv.DictReader(lines, delimiter="\t", quoting=csv.QUOTE_NONE) if suffix == ".tsv" else csv.DictReader(lines)
    try:
        columns = reader.fieldnames or []
        rows, start = [], reader.line_num + 1
        for row in reader:                  # a record's first line, where a quoted field may span several
            rows.append((start, row))
            start = reader.line_num + 1
    except csv.Error as exc:
        raise ValueError(f"{path}: line {reader.line_num + 1}: {exc}") from None  # the line it failed on
    if not {"sentence1", "sentence2", "label"} <= set(columns):
        raise ValueError(f"{path}: expected columns sentence1, sentence2, label")
    twice = sorted({c for c in columns if columns.count(c) > 1} & {"sentence1", "sentence2", "label"})
    if twice:
        raise ValueError(f"{path}: column(s) {twice} appear twice in the header")
    out = []
    for number, row in rows:
        label = (row["label"] or "").strip()
        if label not in ("0", "1"):
            raise ValueError(f"{path}: line {number}: label must be 0 or 1, got {row['label']!r}")
        out.append((f"line {number}", row["sentence1"] or "", row["sentence2"] or "", label == "1"))
    return out


def load_shared(datasets: Path) -> list[Pair]:
    """Every shared labelled file, in SHARED_FILES order."""
    return [p for name in SHARED_FILES for p in load_pairs(datasets / name)]


def _identity(text: str) -> str:
    """What makes two sentences the same one for splitting: NFKC, case-folded, letters and digits only."""
    return "".join(ch for ch in unicodedata.normalize("NFKC", text).casefold() if ch.isalnum())


def split_of(pairs: list[Pair]) -> list[str]:
    """"train" / "calib" / "val" per pair (about 60 / 20 / 20 of components), by a hash of the component's root."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for p in pairs:
        a, b = find(_identity(p.cached)), find(_identity(p.query))
        if a != b:                                   # the smaller key becomes the root: roots are component minima
            parent[max(a, b)] = min(a, b)
    out = []
    for p in pairs:
        unit = int.from_bytes(hashlib.sha1(find(_identity(p.cached)).encode()).digest()[:8], "big") / 2**64
        out.append(next(name for name, upper in SPLITS if unit < upper))
    return out


def shared_split(datasets: Path, split: str) -> list[Pair]:
    """One split of the shared files, computed over all of them at once (a sentence two files share stays in one)."""
    if split not in SPLIT_NAMES:            # else an empty list, as if the split held nothing
        raise ValueError(f"split must be one of {', '.join(SPLIT_NAMES)}, got {split!r}")
    pairs = load_shared(datasets)
    return [p for p, s in zip(pairs, split_of(pairs), strict=True) if s == split]
