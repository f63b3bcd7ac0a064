"""Labelled question pairs (the shared data sets, or a user's file), and the leak-free train / calib / val split that
training, calibration and the quality bench all use.

The split is by connected component: sentences are nodes (after light normalisation), pairs are edges, and a whole
component goes to one split, chosen by a hash of its smallest member. So no sentence (up to case, width, spacing and
punctuation) is in two splits, the assignment needs no random state, and it does not move when files are added.
"""
from __future__ import annotations

import csv
import hashlib
import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from strata.cache.request.calibration import language_of

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


def load_pairs(path: Path | str) -> list[Pair]:
    """Read JSONL {cached, query, same}, CSV/TSV with sentence1, sentence2, label (other columns ignored), or a JSON
    list of {origin, similar} (positives only); clear errors for anything else."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"pairs file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        missing = [i for i, r in enumerate(rows) if not isinstance(r, dict) or not {"cached", "query", "same"} <= r.keys()]
        if missing:
            raise ValueError(f"{path}: line {missing[0] + 1} lacks one of cached/query/same")
        wrong = next((i for i, r in enumerate(rows) if not isinstance(r["same"], bool)), None)
        if wrong is not None:
            raise ValueError(f"{path}: line {wrong + 1}: 'same' must be true or false, got {rows[wrong]['same']!r}")
        raw = [(r["cached"], r["query"], r["same"]) for r in rows]
    elif suffix in (".csv", ".tsv"):
        with path.open(encoding="utf-8", newline="") as f:
            # no quoting in TSV: its sentences hold stray quote characters that must not open a field
            reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE) if suffix == ".tsv" else csv.DictReader(f)
            try:
                rows = list(reader)
            except csv.Error as exc:
                raise ValueError(f"{path}: line {reader.line_num + 1}: {exc}") from None  # the line it failed on
        if not rows or not {"sentence1", "sentence2", "label"} <= rows[0].keys():
            raise ValueError(f"{path}: expected columns sentence1, sentence2, label")
        wrong = next((i for i, r in enumerate(rows) if (r["label"] or "").strip() not in ("0", "1")), None)
        if wrong is not None:
            raise ValueError(f"{path}: row {wrong + 1}: label must be 0 or 1, got {rows[wrong]['label']!r}")
        raw = [(r["sentence1"], r["sentence2"], r["label"].strip() == "1") for r in rows]
    elif suffix == ".json":
        rows = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(rows, list) or not all(isinstance(r, dict) and {"origin", "similar"} <= r.keys() for r in rows):
            raise ValueError(f"{path}: expected a JSON list of {{origin, similar}}")
        raw = [(r["origin"], r["similar"], True) for r in rows]
    else:
        raise ValueError(f"{path}: unknown pairs format {suffix!r} (use .jsonl, .csv, .tsv or .json)")
    long = next((i for i, (a, b, _) in enumerate(raw) if len(str(a)) + len(str(b)) > MAX_PAIR_CHARS), None)
    if long is not None:
        raise ValueError(f"{path}: pair {long + 1} is longer than {MAX_PAIR_CHARS} characters: questions, not "
                         "documents (each is embedded and read by the cross-encoder)")
    domain = domain_of(path)
    pairs = [Pair(a.strip(), b.strip(), same, language_of(b), domain) for a, b, same in raw
             if isinstance(a, str) and isinstance(b, str) and a.strip() and b.strip()]
    if not pairs:
        raise ValueError(f"{path}: no pairs")
    return pairs


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
