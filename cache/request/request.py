"""What the server hands the request cache, and what a hit hands back."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

MODES = ("auto", "off", "exact-only", "refresh")
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def _check_name(what: str, value: object) -> None:
    if not isinstance(value, str) or not value or "|" in value:
        raise ValueError(f"{what} must be a non-empty str without '|', got {value!r}")


@dataclass(slots=True)
class CacheRequest:
    """One chat request as the cache sees it; validated on creation so bad input fails with a clear ValueError."""

    tenant: str                       # "default" when auth is off
    model: str                        # model id + version: entries of another version never match
    messages: list[dict]              # OpenAI chat messages
    sampling: dict = field(default_factory=dict)  # only what changes the answer (temperature, top_p, max_tokens, stop, tools, seed, ...)
    mode: str = "auto"                # "auto" | "off" | "exact-only" | "refresh"
    no_cache: bool = False            # Cache-Control: no-cache -> skip lookup, still write
    no_store: bool = False            # Cache-Control: no-store -> neither look up nor write
    client_id: str | None = None      # for the penetration guard
    draft_answers: int = 0            # on a miss, the answers of up to this many closest candidates not served (drafts)
    origin: str | None = None         # the client request it is part of (several prompts): none waits on another's flight
    verbatim: bool = False            # a completion prompt: keyed on its exact characters, exact layer only

    def __post_init__(self) -> None:
        _check_name("tenant", self.tenant)
        _check_name("model", self.model)
        if not isinstance(self.messages, list) or not self.messages:
            raise ValueError("messages must be a non-empty list of chat messages")
        for i, msg in enumerate(self.messages):
            if not isinstance(msg, dict) or msg.get("role") not in ROLES:
                raise ValueError(f"messages[{i}] must be a dict with a role in {sorted(ROLES)}")
            if not isinstance(msg.get("content"), (str, list, type(None))):
                raise ValueError(f"messages[{i}].content must be a str, a list of parts or None")
        if not isinstance(self.sampling, dict):
            raise ValueError("sampling must be a dict")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.client_id is not None and not isinstance(self.client_id, str):
            raise ValueError("client_id must be a str or None")
        if not isinstance(self.draft_answers, int) or self.draft_answers < 0:
            raise ValueError("draft_answers must be an integer >= 0")
        if self.origin is not None and not isinstance(self.origin, str):
            raise ValueError("origin must be a str or None")
        if self.verbatim and (len(self.messages) != 1 or not isinstance(self.messages[0].get("content"), str)):
            raise ValueError("a verbatim request is one message of text (a completion prompt)")


@dataclass(slots=True, frozen=True)
class AnswerMeta:
    """What the server knows of an answer besides its text, stored with it and replayed with every hit, so that an
    answer cut at max_tokens still says "length" when it comes from the cache."""

    finish_reason: str                # "stop" | "length" | "tool_calls" | "content_filter" | ...
    completion_tokens: int | None = None   # as generated (a filled-in personal template may differ by a few)

    def __post_init__(self) -> None:
        if not isinstance(self.finish_reason, str) or not self.finish_reason:
            raise ValueError(f"finish_reason must be a non-empty str, got {self.finish_reason!r}")
        tokens = self.completion_tokens
        if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0):
            raise ValueError(f"completion_tokens must be an int >= 0 or None, got {tokens!r}")

    def to_json(self) -> str:
        """The stored form."""
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str) -> AnswerMeta:
        """Read the stored form; keys a later version added are ignored."""
        data = json.loads(raw)
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


@dataclass(slots=True)
class CacheHit:
    """A served answer and where it came from, so the server can say so in headers."""

    layer: str                        # "exact" | "semantic" | "semantic-similar" | "shared" (a concurrent twin's)
    text: str                         # templated answer already filled for this request
    similarity: float | None          # 1.0 for exact
    entry_id: str
    age_s: float
    source: str | None = None         # "shared": the layer that answered the twin (miss = it was computed)
    meta: AnswerMeta | None = None    # as the answer was computed (None: stored before meta existed, or warm-up)
