"""Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n tokens.

Answers that summarise, extract, quote or edit their context copy runs of it; where the last few tokens already
appeared, what followed them then is a good guess of what follows now, and costs no model to find.
"""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

MAX_NGRAM = 4       # the longest tail matched first: a longer match is a more specific, more reliable guess
MIN_NGRAM = 2       # one shared token proposes far more often than it is right


def continuation(haystack: list[int] | np.ndarray, tail: list[int] | np.ndarray, num_tokens: int) -> list[int]:
    """Up to num_tokens tokens that followed the latest match in haystack of tail's last n tokens, for n from
    MAX_NGRAM down to MIN_NGRAM; [] when none matches. With haystack = tail it looks up the sequence itself (the
    tail's own occurrence has no successor, so it never matches)."""
    haystack, tail = np.asarray(haystack), np.asarray(tail)
    for n in range(min(MAX_NGRAM, len(tail), len(haystack) - 1), MIN_NGRAM - 1, -1):
        windows = sliding_window_view(haystack[:-1], n)      # every n-gram that has a successor
        hits = np.flatnonzero((windows == tail[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return haystack[start:start + num_tokens].tolist()
    return []
