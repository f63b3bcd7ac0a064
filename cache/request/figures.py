"""Two questions that both state figures, and not the same ones, ask about different things: "Count to 47" /
"Count to 96", "convert 5 km to miles" / "convert 8 km to miles", "2019年的账单" / "2020年的账单". The cross-encoder
was trained on such pairs (hard_negatives.number) and still let "Count to 47" answer "Count to 96" at a 5% bound,
so the second stage rules them out before it reads them. A question with no figure ("How many legs does a spider
have?" / "... 8 legs") is left to the model: a figure may be spelled out on the other side.
"""
from __future__ import annotations

import re
import unicodedata

_FIGURE = re.compile(r"\d+(?:[.,]\d+)*")


def figures(text: str) -> set[str]:
    """The figures a text states, as written but for width, thousands separators and a decimal's trailing zeros."""
    out = set()
    for m in _FIGURE.finditer(unicodedata.normalize("NFKC", text)):
        value = m.group().replace(",", "")
        out.add(value.rstrip("0").rstrip(".") if "." in value else value)
    return out


def different_figures(a: str, b: str) -> bool:
    """Whether both texts state figures and the two sets differ."""
    fa, fb = figures(a), figures(b)
    return bool(fa) and bool(fb) and fa != fb
