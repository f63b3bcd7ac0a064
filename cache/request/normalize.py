"""Text normalization for cache keys: the same question typed differently gets the same key."""
from __future__ import annotations

import re
import unicodedata

_SPACES = re.compile(r"[^\S\n]+")      # any whitespace except newline (NFKC already maps U+3000 to a space)
_BLANK_LINES = re.compile(r"\n{3,}")


def normalize_text(text: str, casefold: bool = False) -> str:
    """NFKC (full-width -> half-width), unified newlines, collapsed and trimmed whitespace, optional case folding.

    No synonym replacement: two texts share a key only when they are the same text.
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    text = unicodedata.normalize("NFKC", text).replace("\r\n", "\n").replace("\r", "\n")
    lines = (_SPACES.sub(" ", line).strip() for line in text.split("\n"))
    text = _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()
    return text.casefold() if casefold else text
