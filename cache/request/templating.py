"""Templating: personal values shared by a request and its answer become placeholders, filled from the next request."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

from strata.cache.request.pii import PII_KINDS, find_entities

_OPEN, _CLOSE = "\u27e6", "\u27e7"     # ⟦EMAIL_1⟧: brackets that ordinary text does not use
_PLACEHOLDER = re.compile(f"{_OPEN}[A-Z_]+_\\d+{_CLOSE}")
_DYNAMIC_KINDS = PII_KINDS | {"date", "amount"}
_LATIN_WORD = "[0-9A-Za-z_\u00c0-\u024f]"    # letters and digits of Latin-script words (not CJK, which has no spaces)
# What a question or answer says about a personal value itself (its meaning, length, spelling, gender, validity):
# such an answer depends on the value, so it must not be refilled with another one ("Yes, Robert is a
# traditionally female name"). Best effort, like the policy's lists; the answer-side check below backs it up.
_PROPERTY = re.compile(r"(?i:\b(?:mean|means|meaning|letters|(?:first|last|which|what) letter|characters?|digits?"
                       r"|spell\w*|pronounc\w*|origins?|gender|girls?|boys?|female|male|feminine|masculine"
                       r"|valid|invalid|real|fake|rhym\w*|translat\w*"
                       r"|nicknames?|popular|common|rare|unique|short for|stands? for|anagrams?|revers\w*|syllables?"
                       r"|upper ?case|lower ?case|how long|palindromes?|backwards?|vowels?|consonants?|domains?"
                       r"|gmail|outlook|yahoo|hotmail|provider|area code|country code|prefix)\b)"
                       r"|意思|含义|寓意|几个字|多少个字|笔画|怎么读|读音|拼音|男孩|女孩|男名|女名|男生|女生|有效|真假|多长")
# A pronoun after the value points back at it ("My email is ⟦EMAIL_1⟧. Is it a Gmail address?", "Write it backwards"):
# whatever is asked of it is asked of this value, so the answer is this value's alone.
_POINTS_BACK = re.compile(r"(?i:\b(?:it|its|it's|itself|this one|that one)\b)|它|这个名字|这个号码|这个地址")
# A value's kind named again past its declaration ("My name is ⟦NAME_1⟧. How many letters does my name have?")
_KIND_NOUN = {"name": "name|名字|姓名", "email": "e-?mail|邮箱", "phone": "phone|mobile|手机|电话|号码",
              "order_number": "order|订单", "address": "address|地址", "id_number": "ssn|身份证",
              "bank_card": "card|卡号"}


@dataclass(slots=True)
class Templated:
    """A request text with its entities cut out: `text` is keyed, `values` refill the stored answer."""

    text: str
    values: dict[str, str] = field(default_factory=dict)   # placeholder -> value in this request
    personal: bool = False                                  # the request carried PII
    about_value: bool = False                               # it asks about a personal value itself: never templated


def typed_placeholder(text: str) -> bool:
    """Text with the placeholder brackets, as a user may type them ("My name is ⟦NAME_1⟧."): keyed, it would be the
    very key another user's templated request has, and its answer would be served to that user."""
    return _OPEN in text or _CLOSE in text


@lru_cache(maxsize=8192)
def template_request(text: str) -> Templated:
    """Cut the entities out of a request that carries PII; a request without PII keeps its literal text.

    Only personal requests are templated: a non-personal one is cached literally, which is always safe.
    Memoized (a hot question is scanned once), so the result is shared: never mutate it.
    """
    entities = find_entities(text)
    if not any(e.kind in PII_KINDS for e in entities) or _OPEN in text:
        return Templated(text)
    values: dict[str, str] = {}
    by_value: dict[str, str] = {}
    counts: dict[str, int] = {}
    parts, pos = [], 0
    for e in entities:
        name = by_value.get(e.value)
        if name is None:
            counts[e.kind] = counts.get(e.kind, 0) + 1
            name = by_value[e.value] = f"{_OPEN}{e.kind.upper()}_{counts[e.kind]}{_CLOSE}"
            values[name] = e.value
        parts += [text[pos:e.start], name]
        pos = e.end
    parts.append(text[pos:])
    templated = "".join(parts)
    return Templated(templated, values, personal=True, about_value=_asks_about_value(templated, counts))


def _asks_about_value(templated: str, counts: dict[str, int]) -> bool:
    """Whether a templated personal request asks about one of its values rather than only carrying it."""
    masked = _PLACEHOLDER.sub(lambda m: " " * len(m.group()), templated)     # same offsets, no "NAME" inside
    if _PROPERTY.search(masked) or _POINTS_BACK.search(masked, templated.find(_OPEN)):
        return True
    for kind in counts:
        noun = _KIND_NOUN.get(kind)
        if noun is None:
            continue
        placeholder = f"{_OPEN}{kind.upper()}_"
        mentions = re.finditer(f"(?i:{noun})", masked)
        # a mention that introduces the value ("my name is ⟦NAME_1⟧", "order #⟦ORDER_NUMBER_1⟧") is its declaration
        if not all(_introduces(templated[m.end():m.end() + 40], placeholder) for m in mentions):
            return True
    return False


def _introduces(after: str, placeholder: str) -> bool:
    """Whether the text after a mention of a kind reaches that kind's placeholder within the same sentence."""
    head, found, _ = after.partition(placeholder)
    return bool(found) and not re.search(r"[.?!。？！]", head)


def template_answer(answer: str, values: dict[str, str]) -> str | None:
    """The answer with every request value replaced by its placeholder, or None when that is not safe.

    Safe means: every request value appears in the answer, and no other personal or dynamic entity
    (a date, an amount, an e-mail the request did not carry) remains in it.
    """
    if _OPEN in answer or _CLOSE in answer:
        return None
    for name, value in sorted(values.items(), key=lambda kv: -len(kv[1])):
        answer, replaced = _whole_value(value).subn(name, answer)
        if not replaced:
            return None
    if any(e.kind in _DYNAMIC_KINDS for e in find_entities(_PLACEHOLDER.sub(" ", answer))):
        return None
    if any(_PROPERTY.search(answer, m.end(), m.end() + 60) for m in _PLACEHOLDER.finditer(answer)):
        return None                         # "⟦NAME_1⟧ is a traditionally female name": true of this value only
    return answer


def _whole_value(value: str) -> re.Pattern[str]:
    """The value where it stands as a whole word: "Tom" in "Hello Tom!" but not in "Tomorrow" (refilled for Ann, that
    would read "Annorrow"). A Latin letter or digit at the value's edge must not continue into the text beside it;
    a CJK edge has no such boundary to check (Chinese runs words together), so it matches as written."""
    left = f"(?<!{_LATIN_WORD})" if re.match(_LATIN_WORD, value[:1]) else ""
    right = f"(?!{_LATIN_WORD})" if re.match(_LATIN_WORD, value[-1:]) else ""
    return re.compile(left + re.escape(value) + right)


def has_placeholder(text: str) -> bool:
    """Whether text carries a template placeholder (a templated answer, or text that would be mistaken for one)."""
    return _OPEN in text


def fill_answer(answer: str, values: dict[str, str]) -> str | None:
    """A stored answer with its placeholders filled from this request, or None when one has no value."""
    missing = False

    def fill(m: re.Match[str]) -> str:
        nonlocal missing
        value = values.get(m.group())
        missing = missing or value is None
        return value or ""

    filled = _PLACEHOLDER.sub(fill, answer)
    return None if missing else filled
