"""Cache keys: normalized user text + system prompt + model + sorted sampling params + context + tenant."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import xxhash

from strata.cache.request.normalize import normalize_text
from strata.cache.request.request import CacheRequest
from strata.cache.request.templating import Templated, template_request, typed_placeholder

# Request fields that do not change the answer text, so they do not split the cache.
_NOT_IN_KEY = frozenset({"stream", "stream_options", "user"})
# The engine decodes greedily below this temperature (server.engine.sampling_params.MIN_TEMPERATURE, which this
# layer may not import; a test keeps the two equal): such a request gets the greedy answer, so it is cached as one.
GREEDY_BELOW = 1e-5
_NOT_IN_GREEDY_KEY = ("top_p", "top_k", "seed")    # greedy decoding never reads them


class NotCacheable(Exception):
    """A request whose shape the cache cannot key (images, a tool turn): it is bypassed, not rejected."""


@dataclass(slots=True)
class RequestKey:
    """Everything the layers need to find, share and write one request's answer."""

    tenant: str
    model: str
    exact: str                 # entry id: key text + partition
    flight: str                # single-flight identity: literal text + partition (two users' e-mails never share it)
    partition: str             # tenant|model|system hash|context hash|sampling hash
    text: str                  # key text: normalized user text, templated when personal; what the semantic layer indexes
    query: str                 # normalized literal user text
    conversation: str          # every user and assistant turn, normalized: what the bypass rules read
    values: dict[str, str] = field(default_factory=dict)
    personal: bool = False
    about_value: bool = False  # asks about a personal value itself (its meaning, length, ...): never shared


def _hash(text: str) -> str:
    return xxhash.xxh3_64_hexdigest(text.encode())


def _content(msg: dict) -> str:
    content = msg.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise NotCacheable("non-text-content")
        texts.append(part["text"])
    return "\n".join(texts)


_EXACT_IN_FLOAT = 2 ** 53      # every integer up to this is a float exactly


def _canonical(value: object) -> object:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):  # 0 == 0.0, but past 2**53 a float merges neighbouring integers (seeds go to 2**64)
        return float(value) if abs(value) <= _EXACT_IN_FLOAT else value
    if isinstance(value, float):
        return int(value) if value.is_integer() and abs(value) > _EXACT_IN_FLOAT else value
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    raise ValueError(f"sampling value of type {type(value).__name__} is not JSON data")


def sampling_key(sampling: dict) -> str:
    """Sorted canonical JSON of the params that change the answer: 0 == 0.0, stop "x" == ["x"], None dropped, and at a
    greedy temperature one key whatever seed, top_p or top_k say (they split greedy answers for nothing)."""
    params = {k: _canonical(v) for k, v in sampling.items() if v is not None and k not in _NOT_IN_KEY}
    temperature = params.get("temperature")
    if isinstance(temperature, float) and 0 <= temperature < GREEDY_BELOW:   # 0 and 1e-6 decode alike
        params["temperature"] = 0.0
        for name in _NOT_IN_GREEDY_KEY:
            params.pop(name, None)
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    return json.dumps(params, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def build_key(req: CacheRequest, casefold: bool = False) -> RequestKey:
    """Key one request; raises NotCacheable for shapes the cache does not handle."""
    *history, last = req.messages
    if last["role"] != "user":
        raise NotCacheable("not-a-user-turn")
    # a completion prompt is text the model continues: a trailing space or newline, CR LF or a tab is context the
    # next token depends on, so nothing folds and nothing is templated
    query = _content(last) if req.verbatim else normalize_text(_content(last))
    if not query.strip():
        raise NotCacheable("empty-query")
    if not req.verbatim and typed_placeholder(query):
        raise NotCacheable("placeholder-text")
    system, context, turns = [], [], []
    for position, msg in enumerate(history):
        text = normalize_text(_content(msg))
        if msg["role"] in ("system", "developer"):
            # where it stands and that it is there at all: an empty system message replaces a template's default
            # one, and one moved after a turn renders elsewhere; both are other prompts
            system.append([position, msg["role"], text])
            continue
        context.append({**msg, "content": text})
        turns.append(text)      # an assistant's offer to look up the weather, answered "yes please", is real-time
    try:
        context_json = json.dumps(context, sort_keys=True, ensure_ascii=False)
    except TypeError as exc:
        raise ValueError(f"messages are not JSON data: {exc}") from None
    partition = "|".join((req.tenant, req.model, _hash(json.dumps(system, ensure_ascii=False)), _hash(context_json),
                          _hash(sampling_key(req.sampling))))
    templated = Templated(query) if req.verbatim else template_request(query)
    fold = str.casefold if casefold and not req.verbatim else str     # a completion prompt keeps its exact characters
    return RequestKey(
        tenant=req.tenant,
        model=req.model,
        exact=xxhash.xxh3_128_hexdigest(f"{partition}\x00{fold(templated.text)}".encode()),
        flight=xxhash.xxh3_128_hexdigest(f"{partition}\x00{fold(query)}".encode()),
        partition=partition,
        text=templated.text,
        query=query,
        conversation="\n".join([*turns, query]),
        values=templated.values,
        personal=templated.personal,
        about_value=templated.about_value,
    )
