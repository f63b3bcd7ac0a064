"""Finds personal data and other dynamic entities in text (English and Chinese), for the write filter and templating."""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

# Kinds that make a text personal: an entry carrying one is never written unless it can be templated.
PII_KINDS = frozenset({"email", "phone", "id_number", "bank_card", "address", "order_number", "name"})

_MONTHS = r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
_CITIES = (
    "New York", "Los Angeles", "San Francisco", "Chicago", "Seattle", "Boston", "London", "Paris", "Berlin",
    "Madrid", "Rome", "Tokyo", "Seoul", "Singapore", "Sydney", "Toronto", "Mumbai", "Dubai", "Beijing",
    "Shanghai", "Shenzhen", "Guangzhou", "Hong Kong", "Hangzhou", "Chengdu",
    "北京", "上海", "广州", "深圳", "杭州", "成都", "南京", "武汉", "西安", "重庆", "天津", "苏州", "香港", "台北",
)

# Order matters: an earlier pattern claims its span first (a bank card is not also a phone number). A pattern that
# starts with an unbounded run begins only where that run begins (a lookbehind): else a 20,000-digit message is
# rescanned from every position, quadratic, seconds to minutes on the event loop.
_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple((kind, re.compile(p)) for kind, p in (
    ("order_number", r"(?i:order|订单)\s*(?i:number|no\.?|id|号|编号)?\s*(?i:is|是)?\s*[:：#]?\s*(?P<v>[A-Za-z]*\d[A-Za-z0-9-]{3,})"),
    ("name", r"(?i:my name is|i'm called|call me|dear)\s+(?P<v>[A-Z][a-z]+(?: [A-Z][a-z]+)?)"
             r"|(?:我叫|我的名字是|我的名字叫)(?!什么|谁|啥|哪)(?P<v2>[\u4e00-\u9fff]{2,3})"),
    ("email", r"(?<![\w.+-])[\w.+-]+@[\w-]+(?:\.[\w-]+)+"),
    ("id_number", r"(?<![\dA-Za-z])(?:\d{17}[\dXx]|\d{3}-\d{2}-\d{4})(?![\dA-Za-z])"),
    ("bank_card", r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])"),
    ("phone", r"(?<![\dA-Za-z+])(?:\+\d[\d ().-]{6,}\d|\(?\d{3}\)?[ .-]\d{3}[ .-]\d{4}|1[3-9]\d{9})(?!\d)"),
    ("address", r"\d{1,5}\s+(?:[A-Z][a-z]+\s+){1,3}(?:Street|St|Avenue|Ave|Road|Rd|Boulevard|Blvd|Lane|Ln|Drive|Dr|Way)\b\.?"
                r"|[\u4e00-\u9fff\d]{2,20}?(?:路|街|道|巷|弄)\d+号(?:[\u4e00-\u9fff\d]{0,10}室)?"),
    ("date", rf"\d{{4}}-\d{{1,2}}-\d{{1,2}}|\d{{1,2}}/\d{{1,2}}/\d{{2,4}}|{_MONTHS}\.? \d{{1,2}}(?:st|nd|rd|th)?(?:,? \d{{4}})?"
             r"|(?:\d{4}年)?\d{1,2}月\d{1,2}[日号]"),
    ("amount", r"[$€£¥]\s?\d[\d,]*(?:\.\d+)?|(?<![\d,])\d[\d,]*(?:\.\d+)?\s?(?:元|块钱|美元|欧元|(?i:dollars|euros|usd|eur|cny|rmb)\b)"),
    ("city", r"(?<![A-Za-z])(?:" + "|".join(map(re.escape, _CITIES)) + r")(?![A-Za-z])"),
))


@dataclass(slots=True, frozen=True)
class Entity:
    """One dynamic value found in a text, with its span, so templating can cut it out."""

    kind: str
    value: str
    start: int
    end: int


def _luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


# Full-width ASCII (U+FF01..FF5E) and the ideographic space read as their half-width twins: one character each, so
# a match's span in the folded view is its span in the text. Keys keep the width; personal data is found either way.
_HALF_WIDTH = {0xFF01 + i: 0x21 + i for i in range(0x5E)} | {0x3000: 0x20}


def find_entities(text: str) -> list[Entity]:
    """All entities in text, non-overlapping, in reading order; a pattern's named group narrows the value.
    Full-width forms are matched as half-width ones (an e-mail typed with an input method is still an e-mail)."""
    found: list[Entity] = []
    taken: list[tuple[int, int]] = []
    folded = text.translate(_HALF_WIDTH)
    for kind, pattern in _PATTERNS:
        for m in pattern.finditer(folded):
            group = next((g for g in ("v", "v2") if g in pattern.groupindex and m.group(g)), None)
            start, end = m.span(group) if group else m.span()
            if kind == "bank_card" and not _luhn_ok(re.sub(r"\D", "", m.group())):
                continue
            at = bisect.bisect_left(taken, (start, end))      # taken: sorted and disjoint, so two neighbours decide
            if (at and taken[at - 1][1] > start) or (at < len(taken) and taken[at][0] < end):
                continue
            taken.insert(at, (start, end))
            found.append(Entity(kind, text[start:end], start, end))
    return sorted(found, key=lambda e: e.start)


def has_pii(text: str) -> bool:
    """True when text carries personal data (PII_KINDS)."""
    return any(e.kind in PII_KINDS for e in find_entities(text))
