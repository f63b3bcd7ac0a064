"""Cacheability policy: which requests bypass the cache, how long an answer lives, what sampling allows."""
from __future__ import annotations

import json
import re
import threading
import unicodedata
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import opencc
from cachetools import LRUCache, cached

from strata.cache.request.keys import GREEDY_BELOW, RequestKey
from strata.cache.request.request import CacheRequest


@dataclass(slots=True)
class Decision:
    """What the layers may do with one request, and why (the reason goes to headers and counters)."""

    lookup_exact: bool
    lookup_semantic: bool
    write: bool
    write_semantic: bool
    reason: str                 # TTL class when cacheable, else why bypassed
    ttl_class: str = "default"
    ttl_s: float = 0.0

    @property
    def bypass(self) -> bool:
        """Neither layer is looked up (a no-cache request may still be written)."""
        return not (self.lookup_exact or self.lookup_semantic)


def _compile(what: str, patterns: object) -> re.Pattern[str]:
    """One alternation per class, matched against case-folded text (about twice as fast as re.IGNORECASE)."""
    if not isinstance(patterns, list) or not patterns or not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"policy rules: {what} must be a non-empty list of regex strings")
    for p in patterns:
        if re.sub(r"\\.", "", p) != re.sub(r"\\.", "", p).casefold():
            raise ValueError(f"policy rules: {what}: write patterns in lower case (text is case-folded): {p!r}")
    try:
        return re.compile("|".join(f"(?:{p})" for p in patterns))
    except re.error as exc:
        raise ValueError(f"policy rules: bad regex in {what}: {exc}") from None


def _bypass(reason: str) -> Decision:
    return Decision(False, False, False, False, reason)


class Policy:
    """Rules from a JSON file (shipped default: data/policy_rules.json: English and Chinese, and real-time words of
    French, Spanish, German, Portuguese and Italian; other scripts bypass).

    temperature >= GREEDY_BELOW, rule "seeded-exact" (default): exact layer only and only when a seed is given,
    otherwise bypass (an unseeded sample is meant to differ); "exact": exact layer only; "bypass": always bypass.
    """

    def __init__(self, rules: dict, temperature_rule: str = "seeded-exact", default_temperature: float = 1.0):
        if not isinstance(rules, dict) or not isinstance(rules.get("bypass"), dict) or not rules["bypass"]:
            raise ValueError("policy rules need a non-empty 'bypass' object of class -> regex list")
        self.bypass_rules = [(name, _compile(f"bypass.{name}", p)) for name, p in rules["bypass"].items()]
        scripts = rules.get("scripts")
        if scripts is not None and (not isinstance(scripts, list) or not all(isinstance(x, str) for x in scripts)):
            raise ValueError("policy rules: 'scripts' must be a list of Unicode script name prefixes, e.g. [\"LATIN\"]")
        self.scripts = tuple(x.upper() for x in scripts) if scripts is not None else None
        letters = rules.get("latin_letters")
        if letters is not None and not isinstance(letters, str):
            raise ValueError("policy rules: 'latin_letters' must be a string of the accented letters the rules read")
        self.latin_letters = frozenset(letters) if letters is not None else None
        self.ttl_rules: list[tuple[str, float, re.Pattern[str]]] = []
        for i, cls in enumerate(rules.get("ttl_classes", [])):
            if not isinstance(cls, dict) or not isinstance(cls.get("name"), str) or not _positive(cls.get("ttl_s")):
                raise ValueError(f"policy rules: ttl_classes[{i}] needs a name and a positive ttl_s")
            self.ttl_rules.append((cls["name"], float(cls["ttl_s"]), _compile(f"ttl_classes[{i}]", cls.get("patterns"))))
        default = rules.get("default", {"name": "default", "ttl_s": 3600})
        if not isinstance(default, dict) or not _positive(default.get("ttl_s")):
            raise ValueError("policy rules: 'default' needs a positive ttl_s")
        self.default = (str(default.get("name", "default")), float(default["ttl_s"]))
        self.ttls = {name: ttl for name, ttl, _ in self.ttl_rules} | {self.default[0]: self.default[1]}
        self.temperature_rule = temperature_rule
        self.default_temperature = default_temperature
        # the rules are pure functions of the text: memoize them, a hot question is classified once
        self.bypass_reason = cached(LRUCache(8192), lock=threading.Lock())(self.bypass_reason)
        self.ttl_class = cached(LRUCache(8192), lock=threading.Lock())(self.ttl_class)

    @classmethod
    def load(cls, path: str | Path | None = None, **kwargs) -> Policy:
        """Read rules from path, or the shipped defaults when path is None."""
        try:
            text = Path(path).read_text("utf-8") if path else \
                resources.files("strata.cache.request").joinpath("data/policy_rules.json").read_text("utf-8")
            rules = json.loads(text)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read policy rules {path or 'data/policy_rules.json'}: {exc}") from None
        return cls(rules, **kwargs)

    def bypass_reason(self, text: str) -> str | None:
        """The first bypass class whose rules match text (real-time, money, legal, security, ...), else None; text
        with letters of a script the rules do not read ("scripts": Cyrillic, Arabic, kana, ... for the shipped
        rules) is "unvetted-language": no rule could have told a real-time question in it."""
        text = _classified(text)
        if not text.isascii() and any(not self._vetted(ch) for ch in text if ch.isalpha() and not ch.isascii()):
            return "unvetted-language"
        return next((name for name, rx in self.bypass_rules if rx.search(text)), None)

    def _vetted(self, letter: str) -> bool:
        """Whether the rules read this letter's language: its script is in "scripts", and a Latin letter beyond ASCII
        is one of "latin_letters" (the accented letters of the languages the rules are written in: "ı" or "ơ" is
        Turkish or Vietnamese, whose "what time is it" no rule knows)."""
        name = unicodedata.name(letter, "")
        if self.scripts is not None and not name.startswith(self.scripts):
            return False
        return self.latin_letters is None or not name.startswith("LATIN") or letter in self.latin_letters

    def ttl_class(self, text: str) -> tuple[str, float]:
        """(class, ttl seconds) for a cacheable question: status 5 min, conceptual 30 d, factual 7 d, default 1 h."""
        text = _classified(text)
        return next(((name, ttl) for name, ttl, rx in self.ttl_rules if rx.search(text)), self.default)

    def ttl_of(self, name: str) -> float:
        """TTL of a named class (warm-up files name one); unknown names are an error."""
        if name not in self.ttls:
            raise ValueError(f"unknown ttl_class {name!r}; known: {sorted(self.ttls)}")
        return self.ttls[name]

    def decide(self, req: CacheRequest, key: RequestKey) -> Decision:
        """Combine the request's cache flags, the sampling rule and the content rules into one decision."""
        if req.no_store or req.mode == "off":
            return _bypass("no-store" if req.no_store else "mode-off")
        temperature = req.sampling.get("temperature", self.default_temperature)
        if temperature is None:
            temperature = self.default_temperature
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature < 0:
            raise ValueError(f"sampling.temperature must be a number >= 0, got {temperature!r}")
        n = req.sampling.get("n", 1)
        if n not in (None, 1):
            return _bypass("n>1")
        semantic = not req.verbatim        # a continuation depends on the prompt's exact text, not on its meaning
        if temperature >= GREEDY_BELOW:
            if self.temperature_rule == "bypass" or (self.temperature_rule == "seeded-exact" and req.sampling.get("seed") is None):
                return _bypass("sampling")
            semantic = False
        reason = self.bypass_reason(key.conversation) or ("personal-value" if key.about_value else None)
        if reason:
            return _bypass(reason)
        ttl_class, ttl_s = self.ttl_class(key.query)
        lookup = not (req.no_cache or req.mode == "refresh")
        semantic_lookup = lookup and semantic and req.mode != "exact-only"
        reason = ttl_class if lookup else ("no-cache" if req.no_cache else "refresh")
        return Decision(lookup, semantic_lookup, True, semantic, reason, ttl_class, ttl_s)


def _classified(text: str) -> str:
    """What the rules read: NFKC (full-width and other compatibility forms as plain ones), case-folded, and Chinese
    in Simplified characters (OpenCC's t2s), as the rules are written. Keys keep those differences, but the rules
    must not miss "ｂｉｔｃｏｉｎ ｐｒｉｃｅ" or "現在比特幣的價格" for them."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return _simplified(text) if _CJK.search(text) else text


_CJK = re.compile("[\u3400-\u9fff\uf900-\ufaff]")
_simplified = opencc.OpenCC("t2s").convert


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
