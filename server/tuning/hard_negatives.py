"""Synthetic near-miss negatives for training the cross-encoder: a same-intent pair whose new question is edited so
that it asks something else while its words barely change.

The shipped adapter's top-scored false pairs are this kind (a reversed conversion, a changed figure, a dropped
"not"), and the public sets hold few of them, so the model learned "same words, same intent". Three edits, chosen a
priori from the kinds of contrast the issue names (numbers, negation, argument order), applied to the query side of
TRAIN positives only; each edit keeps the sentence grammatical:

- ``number``: a number both sides share is changed in the query (the shared figure is the fact asked about);
- ``swap``: the two nouns of an ordered relation trade places ("from Paris to Rome", "convert pounds to kilograms",
  "is gold heavier than silver");
- ``negation`` (Chinese): "不" comes out of "不能 / 不可以 / 不会", or goes in before 能 / 可以 in a why- or
  how-question ("为什么能用" -> "为什么不能用"); never in a yes/no question, where "不能...吗" is rhetorical and
  the intent unchanged;
- ``contrast``: a word both sides share is replaced by its opposite or a sibling of its closed class ("left eye" ->
  "right eye", "translate to French" -> "to Spanish", "开通" -> "关闭", "上个月" -> "下个月"): one word that decides
  the answer, the rest unchanged. The classes are general vocabulary (directions, opposites, weekdays, months,
  colours, languages, units; cache/request/contrast.py, where serving rules such pairs out too), not words picked
  from any pairs.
"""
from __future__ import annotations

import random
import re
from dataclasses import replace

from strata.cache.request.contrast import EN_CLASSES, ZH_CLASSES, siblings
from strata.server.tuning.pairs import Pair

KINDS = ("number", "swap", "negation", "contrast")
DEFAULT_KINDS = KINDS[:3]    # what trained the shipped adapter (contrast: opt-in, see docs/semantic-quality.md)
_NUMBER = re.compile(r"(?<![A-Za-z\d.])\d+(?![A-Za-z\d.])")     # a figure, not part of a name ("S3", "uint8")
_ARTICLE = r"(?:(?:an?|the|one|my|your) )?"
_ORDERED = (  # groups 1 and 2: the two nouns that trade places
    re.compile(rf"\bfrom {_ARTICLE}([A-Za-z]{{3,}}) to {_ARTICLE}([A-Za-z]{{3,}})\b", re.I),
    re.compile(rf"\b(?:convert|change|turn|translate|switch)(?:ing|s|ed)? {_ARTICLE}([A-Za-z]{{3,}}) (?:to|into) "
               rf"{_ARTICLE}([A-Za-z]{{3,}})\b", re.I),
    re.compile(rf"\b(?:is|are|was|were) {_ARTICLE}([A-Za-z]{{3,}}) (?:[A-Za-z]+er|more [A-Za-z]+|less [A-Za-z]+) "
               rf"than {_ARTICLE}([A-Za-z]{{3,}})\b", re.I),
)
# 能 / 可以 as a modal, not inside a word (可能, 功能, 能量, 能否) nor "能不能" or "才能"
_MODAL = re.compile(r"(?<![不没别才可功智性体技本万异动潜热电核节职效无全])(能|可以)(?![否不量力源手耐])")
_WHY_OR_HOW = re.compile(r"为什么|为啥|为何|怎么")      # where "can" -> "cannot" flips the question
_NEGATED_MODAL = re.compile(r"(?<![能可会])不(能|可以|会)")         # not the A-not-A "能不能", "可不可以"
_SWAP_MAX_WORDS = 15
_YES_NO = re.compile(r"[吗么嘛][\s?？。!！]*$")


def _changed_number(pair: Pair, rng: random.Random) -> str | None:
    cached = set(_NUMBER.findall(pair.cached))
    shared = [m for m in _NUMBER.finditer(pair.query) if m.group() in cached]
    if not shared:
        return None
    m = rng.choice(shared)
    value = int(m.group())
    other = value + rng.choice([d for d in range(-9, 10) if d and value + d >= 0])
    return pair.query[:m.start()] + str(other) + pair.query[m.end():]


def _swapped(pair: Pair, rng: random.Random) -> str | None:
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS

    if len(pair.query.split()) > _SWAP_MAX_WORDS:      # long news sentences: "from" / "to" rarely join two nouns
        return None
    spots = [m for pattern in _ORDERED for m in pattern.finditer(pair.query)
             if m.group(1).lower() != m.group(2).lower()
             and not ({m.group(1).lower(), m.group(2).lower()} & ENGLISH_STOP_WORDS)
             and not any(w.lower().endswith(("ly", "ing")) for w in m.groups())]
    if not spots:
        return None
    m = rng.choice(spots)
    q = pair.query
    return q[:m.start(1)] + m.group(2) + q[m.end(1):m.start(2)] + m.group(1) + q[m.end(2):]


def _negated(pair: Pair, rng: random.Random) -> str | None:
    if pair.lang != "zh" or _YES_NO.search(pair.query):
        return None
    negated = list(_NEGATED_MODAL.finditer(pair.query))
    if negated:
        m = rng.choice(negated)
        return pair.query[:m.start()] + m.group(1) + pair.query[m.end():]
    if "不" in pair.query or "没" in pair.query or not _WHY_OR_HOW.search(pair.query):
        return None
    spots = list(_MODAL.finditer(pair.query))
    if not spots:
        return None
    m = rng.choice(spots)
    return pair.query[:m.start()] + "不" + pair.query[m.start():]


_EN_SIBLINGS = siblings(EN_CLASSES)
_ZH_SIBLINGS = siblings(ZH_CLASSES)
_EN_WORD = re.compile(r"[A-Za-z]+")
# Chinese contrast words, longest first, so "上个月" is one word and not a "上" inside it
_ZH_WORD = re.compile("|".join(sorted(map(re.escape, _ZH_SIBLINGS), key=len, reverse=True)))


def _contrasted(pair: Pair, rng: random.Random) -> str | None:
    if pair.lang == "zh":
        shared = set(_ZH_WORD.findall(pair.cached))
        spots = [(m.start(), m.end(), m.group()) for m in _ZH_WORD.finditer(pair.query) if m.group() in shared]
        if not spots:
            return None
        start, end, word = rng.choice(spots)
        return pair.query[:start] + rng.choice(_ZH_SIBLINGS[word]) + pair.query[end:]
    shared = {w.casefold() for w in _EN_WORD.findall(pair.cached)}
    spots = [m for m in _EN_WORD.finditer(pair.query) if m.group().casefold() in shared
             and m.group().casefold() in _EN_SIBLINGS]
    if not spots:
        return None
    m = rng.choice(spots)
    other = rng.choice(_EN_SIBLINGS[m.group().casefold()])
    if m.group().isupper() and len(m.group()) > 1:
        other = other.upper()
    elif m.group()[0].isupper():
        other = other.capitalize()
    return pair.query[:m.start()] + other + pair.query[m.end():]


_EDITS = {"number": _changed_number, "swap": _swapped, "negation": _negated, "contrast": _contrasted}


def hard_negatives(pairs: list[Pair], kinds: tuple[str, ...] = DEFAULT_KINDS, seed: int = 0) -> list[Pair]:
    """One edited negative per same-intent pair and kind where the edit applies, domain "synthetic_<kind>"; the
    same for the same pairs and seed."""
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown hard-negative kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    rng, out = random.Random(seed), []
    for pair in pairs:
        if not pair.same:
            continue
        for kind in kinds:
            edited = _EDITS[kind](pair, rng)
            if edited is not None and edited != pair.query:
                out.append(replace(pair, query=edited, same=False, domain=f"synthetic_{kind}"))
    return out
