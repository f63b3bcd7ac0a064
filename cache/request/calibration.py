"""A user-set error bound on semantic hits: thresholds chosen on labelled, held-out pairs so that the upper 95%
Clopper-Pearson bound of the false-hit rate among the answers served is at most D (`--cache-semantic-max-error`).

A threshold is certified on scored calibration pairs (data/semantic_calibration.npz, or a user's file from
`strata calibrate`). Per language and tier: the plain "serve" tier must hold the bound D/4 (an answer given as if it
were the question's own), the "similar" tier the bound D over every answer served from its threshold up, both tiers
(it is for right answers worded for another question, not a second chance for doubtful ones; and a smaller D never
serves more). With several domains in the data (the shipped file has eight public sets), the bound is taken over the pooled pairs and, in addition, each domain's own false-hit share must stay
within it ("hybrid"): a threshold that holds on average while one kind of traffic fails is not certified. Where no
threshold meets the bound, that language is not served semantically at all.
"""
from __future__ import annotations

import functools
import json
import math
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

LANGUAGES = ("en", "zh")
# The second stage's decision score is its logit plus this times the candidate's cosine. The cross-encoder's logit
# saturates (about 4.1-4.2 on every confident pair), so inside that band its ranking is noise; the cosine orders it.
# Set a priori to one logit unit per unit of cosine, not fitted: 0.3-2 certify alike (docs/semantic-quality.md).
COSINE_WEIGHT = 1.0
SERVE_SHARE = 0.25                      # the serve tier's bound, as a share of D
CONFIDENCE = 0.95
CALIBRATION_PATH = Path(__file__).with_name("data") / "semantic_calibration.npz"
OFF = math.inf                          # a threshold nothing reaches: the tier (or language) serves nothing


def decision_score(logit, cosine):
    """What the tiers threshold with a second stage: its logit, the cosine breaking its saturation (COSINE_WEIGHT)."""
    return logit + COSINE_WEIGHT * cosine


def cp_upper(k: np.ndarray | int, n: np.ndarray | int, confidence: float = CONFIDENCE) -> np.ndarray:
    """One-sided upper Clopper-Pearson bound on a rate seen as k events in n trials (1 where n = 0)."""
    from scipy.stats import beta

    k, n = np.asarray(k, float), np.asarray(n, float)
    with np.errstate(invalid="ignore", divide="ignore"):
        upper = beta.ppf(confidence, k + 1, np.maximum(n - k, 1e-12))
    return np.where((n > 0) & (k < n), upper, 1.0)


@dataclass(frozen=True, slots=True)
class Tiers:
    """One language's decision: the second stage is asked only at cosine >= floor; score >= serve is a plain
    semantic hit, score >= similar one marked "based on a similar question"."""

    serve: float
    similar: float
    floor: float = -1.0

    def __post_init__(self) -> None:
        if not self.similar <= self.serve:
            raise ValueError(f"need similar <= serve, got similar={self.similar} serve={self.serve}")

    @property
    def off(self) -> bool:
        return math.isinf(self.similar)

    def for_text(self, text: str) -> Tiers:
        """One set for every language (a TierTable has one per language)."""
        return self

    def tier(self, score: float) -> str | None:
        return "serve" if score >= self.serve else "similar" if score >= self.similar else None


OFF_TIERS = Tiers(OFF, OFF)              # a language nothing certified, or none calibrated


@dataclass(frozen=True, slots=True)
class TierTable:
    """Tiers per language: Chinese questions (any CJK character) and everything else, scored on their own scales."""

    en: Tiers
    zh: Tiers

    def for_text(self, text: str) -> Tiers:
        """The tiers of the text's language; a language no pairs calibrate (French, ...) serves nothing."""
        return {"en": self.en, "zh": self.zh}.get(language_of(text), OFF_TIERS)

    def served_languages(self) -> list[str]:
        return [lang for lang in LANGUAGES if not getattr(self, lang).off]


# Latin-script languages the cacheability rules read besides English (policy_rules.json): told apart from English so
# that a French question never gets an English answer and is never judged by English thresholds.
OTHER_LATIN = ("fr", "es", "de", "it", "pt")
OTHER_LATIN_CONFIDENCE = 0.9    # below it a text stays English: a short English question ("Define entropy") is often
# a weak guess for another language (0.4% of en hard pairs above it, 0 of 5,929 MRPC / GPTCache / MeanCache texts)


@functools.lru_cache(maxsize=8192)
def language_of(text: str) -> str:
    """"zh" when the text has any CJK ideograph; one of OTHER_LATIN when py3langid says so with confidence; else
    "en": the rule for picking thresholds, at calibration and at serving alike (only "en" and "zh" have any)."""
    if any("\u3400" <= ch <= "\u9fff" or "\uf900" <= ch <= "\ufaff" for ch in text):
        return "zh"
    language, confidence = _latin_identifier().classify(text)
    return language if language != "en" and confidence >= OTHER_LATIN_CONFIDENCE else "en"


@functools.cache
def _latin_identifier():
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    identifier.set_languages(["en", *OTHER_LATIN])
    return identifier


@dataclass
class ScoredPairs:
    """Labelled pairs with what the semantic layer would see: each embedder's cosine and the second stage's score."""

    label: np.ndarray                                  # bool: the same question
    lang: np.ndarray                                   # "en" | "zh" (of the query)
    domain: np.ndarray                                 # which data set a pair came from
    score: np.ndarray                                  # second-stage logit; NaN where not scored
    cosine: dict[str, np.ndarray] = field(default_factory=dict)   # embedder name -> cosine (NaN: not computed)
    meta: dict = field(default_factory=dict)           # second-stage version, sources, date
    adapter: dict[str, np.ndarray] | None = None       # a second stage fitted to these pairs' source, bundled

    def save(self, path: Path) -> None:
        arrays = {f"cosine:{name}": v.astype(np.float32) for name, v in self.cosine.items()}
        arrays |= {f"adapter:{k}": v for k, v in (self.adapter or {}).items()}
        with open(path, "wb") as f:            # exactly this path (np.savez would add ".npz" to a bare name)
            # strings at their full length: two sources whose names shared 32 characters became one domain, and
            # the per-domain rule the file was fitted with no longer held where it is served
            np.savez_compressed(f, label=self.label.astype(bool), lang=self.lang.astype(str),
                                domain=self.domain.astype(str), score=self.score.astype(np.float32),
                                __meta__=np.array(json.dumps(self.meta)), **arrays)

    @classmethod
    def load(cls, path: Path = CALIBRATION_PATH) -> ScoredPairs:
        """The pairs of a file `strata calibrate` wrote; ValueError naming the file for anything else."""
        try:
            loaded = np.load(path, allow_pickle=False)
            if not isinstance(loaded, np.lib.npyio.NpzFile):
                raise ValueError("one array, not an .npz archive")
            with loaded as z:
                cosine = {k.split(":", 1)[1]: z[k] for k in z.files if k.startswith("cosine:")}
                adapter = {k.split(":", 1)[1]: z[k] for k in z.files if k.startswith("adapter:")}
                columns = [z["label"], z["lang"], z["domain"], z["score"], *cosine.values()]
                if any(c.ndim != 1 for c in columns) or len({len(c) for c in columns}) != 1:
                    raise ValueError("its pair arrays are not one row per pair")
                if z["label"].dtype != bool:
                    raise ValueError(f"labels of type {z['label'].dtype}, not true / false")
                data = cls(z["label"], z["lang"].astype(str), z["domain"].astype(str), z["score"].astype(np.float64),
                           {k: v.astype(np.float64) for k, v in cosine.items()}, json.loads(str(z["__meta__"])),
                           adapter or None)
        except FileNotFoundError:
            raise ValueError(f"calibration file not found: {path}") from None
        except (OSError, KeyError, ValueError, TypeError, EOFError, zipfile.BadZipFile) as exc:
            raise ValueError(f"{path} is not a calibration file written by `strata calibrate` ({exc})") from None
        if not isinstance(data.meta, dict):
            raise ValueError(f"{path} is not a calibration file written by `strata calibrate` (its metadata)")
        return data


def certified(score: np.ndarray, label: np.ndarray, domain: np.ndarray, bound: float,
              confidence: float = CONFIDENCE) -> float:
    """The lowest threshold t such that the pairs scored at t or above keep the false-hit share within `bound`:
    pooled upper CP bound <= bound, and each domain's own share <= bound, at t and at every threshold above it
    (fixed-sequence testing: the thresholds are tested from the top down and the first that fails ends the search,
    so the 95% holds for the threshold chosen, not only for each one alone; those serving too few pairs to pass
    even with no false hit are skipped, which needs no label). OFF when none does."""
    candidates = np.unique(score[np.isfinite(score)])[::-1]
    if not len(candidates):
        return OFF
    order = np.argsort(-score, kind="stable")
    ranked = score[order]
    served = np.searchsorted(-ranked, -candidates, side="right")      # pairs at or above each candidate
    false = np.r_[0, np.cumsum(~label[order])][served]
    ok = cp_upper(false, served, confidence) <= bound
    for name in np.unique(domain):
        mine = domain[order] == name
        n = np.r_[0, np.cumsum(mine)][served]
        k = np.r_[0, np.cumsum(mine & ~label[order])][served]
        ok &= np.where(n > 0, k / np.maximum(n, 1), 0.0) <= bound
    testable = np.flatnonzero(cp_upper(0, served, confidence) <= bound)
    failed = np.flatnonzero(~ok[testable])
    passed = testable[:failed[0]] if len(failed) else testable
    return float(candidates[passed[-1]]) if len(passed) else OFF


def fit_tiers(data: ScoredPairs, embedder: str, second_stage: bool, max_error: float,
              floor_quantile: float = 0.02) -> tuple[TierTable, dict]:
    """Tiers per language for this embedder and bound, and a report of what was certified on how many pairs.

    With the second stage the score is decision_score (its logit and the cosine), asked only at cosine >= floor (the
    cosine that all but floor_quantile of the language's positive pairs reach); without it the score is the cosine
    itself."""
    if not 0 < max_error < 1:
        raise ValueError(f"max_error must be in (0, 1), got {max_error}")
    if embedder not in data.cosine:
        raise KeyError(f"the calibration pairs have no cosines for embedder {embedder!r} "
                       f"(have {sorted(data.cosine)}): run `strata calibrate` with it")
    cosine = data.cosine[embedder]
    # A data set of paraphrases only says nothing about false hits and would dilute their share: left out.
    judged = np.isin(data.domain, [d for d in np.unique(data.domain) if (~data.label[data.domain == d]).any()])
    tiers, report = {}, {}
    for lang in LANGUAGES:
        mine = (data.lang == lang) & np.isfinite(cosine) & judged
        if second_stage:
            mine &= np.isfinite(data.score)
        positives = cosine[mine & data.label]
        if not mine.any() or not (mine & ~data.label).any() or not len(positives):
            reason = "no labelled pairs" if not (data.lang == lang).any() else \
                "needs both same-intent and different-intent pairs (a set of one kind says nothing about false hits)"
            tiers[lang], report[lang] = OFF_TIERS, {"pairs": int(mine.sum()), "reason": reason}
            continue
        floor = float(np.quantile(positives, floor_quantile)) if second_stage else -1.0
        score = np.where(cosine >= floor, decision_score(data.score, cosine) if second_stage else cosine,
                         -math.inf)[mine]
        label, domain = data.label[mine], data.domain[mine]
        serve = certified(score, label, domain, max_error * SERVE_SHARE)
        similar = min(certified(score, label, domain, max_error), serve)
        tiers[lang] = Tiers(serve, similar, floor)
        hits = score >= similar
        report[lang] = {"pairs": int(mine.sum()), "positives": int(label.sum()), "served": int(hits.sum()),
                        "false": int((hits & ~label).sum()), "serve": _rounded(serve), "similar": _rounded(similar),
                        "floor": round(floor, 4)}
    return TierTable(**tiers), report


def _rounded(value: float) -> float | None:
    return None if math.isinf(value) else round(value, 4)
