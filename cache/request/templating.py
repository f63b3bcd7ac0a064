"""Templating: personal values shared by a request and its answer become placeholders, filled from the next request."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

from strata.cache.request.pii import PII_KINDS, find_entities

_OPEN, _CLOSE = "\u27e6", "\u27e7"     # ⟦EMAIL_1⟧: brackets that ordinary text does not use
_PLACEHOLDER = re.compile(f"{_OPEN}[A-Z_]+_\\d+{_CLOSE}")
_DYNAMIC_KINDS = PII_KINDS | {"date", "amount"}


@dataclass(slots=True)
class Templated:
    """A request text with its entities cut out: `text` is keyed, `values` refill the stored answer."""

    text: str
    values: dict[str, str] = field(default_factory=dict)   # placeholder -> value in this request
    personal: bool = False                                  # the request carried PII


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
    return Templated("".join(parts), values, personal=True)


def template_answer(answer: str, values: dict[str, str]) -> str | None:
    """The answer with every request value replaced by its placeholder, or None when that is not safe.

    Safe means: every request value appears in the answer, and no other personal or dynamic entity
    (a date, an amount, an e-mail the request did not carry) remains in it.
    """
    if _OPEN in answer or _CLOSE in answer:
        return None
    for name, value in sorted(values.items(), key=lambda kv: -len(kv[1])):
        if value not in answer:
            return None
        answer = answer.replace(value, name)
    if any(e.kind in _DYNAMIC_KINDS for e in find_entities(_PLACEHOLDER.sub(" ", answer))):
        return None
    return answer


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
