"""Two questions made of the same words with two parts trading places across a word between them ask the other way
round: "lb to kg" / "kg to lb", "冰变成水" / "水变成冰", "How many kilograms is one pound?" / "How many pounds is
one kilogram?". The cross-encoder sees every word of one in the other and scores them like paraphrases (logit +
cosine about 6.0, above English's threshold at a 5% bound), so the second stage rules them out before it reads them.

Not a transposition: parts trading places with nothing between them ("为什么花呗不能用" / "花呗为什么不能用": the
same question, fronted), or across a symmetric join or a list ("cats and dogs" / "dogs and cats", "北京和上海" /
"上海和北京", "A、B和C" / "C、B和A").
"""
from __future__ import annotations

import re

_IDEOGRAPH = r"\u3400-\u9fff\uf900-\ufaff"
_TOKEN = re.compile(rf"[{_IDEOGRAPH}]|[^\W_{_IDEOGRAPH}]+|[、,，;；/]")  # an ideograph, a word, a list separator
_SEPARATORS = str.maketrans("、，；;/", ",,,,,")
# Joins (and list separators) whose two sides can trade places without changing the question.
_SYMMETRIC = frozenset({",", "and", "or", "vs", "versus", "between", "both", "either", "和", "与", "跟", "或", "及",
                        "同", "是", "又"})
_MAX_TOKENS = 96           # longer texts are statements, not questions a cache serves: never called transposed
_SLACK = 6                 # how far X and Y may reach into the common prefix / suffix ("反义词或近义词": 义词 is shared)


def tokens(text: str) -> list[str]:
    """Case-folded words (a plural's "s" dropped, so "kilograms" meets "kilogram"), single ideographs, and list
    separators (all as ",")."""
    out = []
    for w in _TOKEN.findall(text.casefold().translate(_SEPARATORS)):
        if len(w) > 3 and w.endswith("s") and not w.endswith("ss"):
            w = w[:-1]
        out.append(w)
    return out


def _middles(a: list[str], b: list[str]):
    """Every (X, M, Y) with a = P X M Y S and b = P Y M X S, X and Y non-empty and different, M possibly empty."""
    n = len(a)
    prefix = next((i for i in range(n) if a[i] != b[i]), n)
    suffix = next((i for i in range(n) if a[n - 1 - i] != b[n - 1 - i]), n)
    for p in range(prefix, max(-1, prefix - _SLACK - 1), -1):
        for s in range(suffix, max(-1, suffix - _SLACK - 1), -1):
            ma, mb = a[p:n - s], b[p:n - s]
            m = len(ma)
            xs = [x for x in range(1, m) if ma[:x] == mb[m - x:]]
            ys = [y for y in range(1, m) if ma[m - y:] == mb[:y]]
            for x in xs:
                for y in ys:
                    if x + y <= m and ma[x:m - y] == mb[y:m - x] and ma[:x] != ma[m - y:]:
                        yield ma[:x], ma[x:m - y], ma[m - y:]


def transposed(a: str, b: str) -> bool:
    """Whether b is a with two parts swapped around a middle that is not empty and holds no symmetric join, and no
    other reading of the two as a swap is an adjacent or symmetric one."""
    ta, tb = tokens(a), tokens(b)
    if len(ta) != len(tb) or ta == tb or len(ta) > _MAX_TOKENS:
        return False
    ordered = False
    for _, middle, _ in _middles(ta, tb):
        if not middle or _SYMMETRIC & set(middle):
            return False
        ordered = True
    return ordered
