"""OpenAI request bodies as pydantic models (plus Strata's cache extensions) and the response/chunk shapes."""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from strata.server.api.unsupported import (
    BestOf,
    NullOnly,
    ResponseFormat,
)
from strata.server.engine.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOPS,
    PENALTY_RANGE,
    REPETITION_PENALTY_RANGE,
    InvalidParam,
)

# Sampling fields beyond the original few (OpenAI's penalties, vLLM's extensions) that change the answer: part of the
# exact-cache key when not at their defaults.
ANSWER_EXTENSIONS = frozenset({"ignore_eos", "min_tokens", "stop_token_ids", "skip_special_tokens",
                               "include_stop_str_in_output", "repetition_penalty", "presence_penalty",
                               "frequency_penalty"})
# Fields whose null means "the default" in OpenAI's API (the others it types nullable are `X | None` here already).
NULL_IS_DEFAULT = frozenset({"temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty"})
# One stop string or a list of them, read as a list, so an error names `stop` (not a member of a union).
Stops = Annotated[Annotated[list[str], Field(max_length=MAX_STOPS)] | None,
                  BeforeValidator(lambda v: [v] if isinstance(v, str) else v),
                  WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"},
                                                                   "maxItems": MAX_STOPS}, {"type": "null"}]})]
Penalty = Annotated[StrictFloat, Field(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1], allow_inf_nan=False)]
TopLogprobs = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]

CacheMode = Literal["auto", "off", "exact-only", "refresh"]
MAX_PROMPTS = 64        # prompts in one completions request: each is a sequence of its own in the engine
MAX_CHOICES = 64        # choices in one request (prompts x n), for the same reason
PROMPT_FORMS = "a string, a list of strings, a list of token ids or a list of lists of token ids"


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int and t >= 0 for t in value)


def as_prompts(value):
    """OpenAI's four prompt forms as one list of prompts (each a string or a list of token ids), so the error of a
    malformed or empty one names `prompt` itself, not a member of a union."""
    if isinstance(value, str):
        return [value]
    if _is_ids(value):
        return [value]
    if isinstance(value, list) and value and (all(isinstance(v, str) for v in value) or all(map(_is_ids, value))):
        if len(value) > MAX_PROMPTS:
            raise PydanticCustomError("invalid_value", "at most {n} prompts per request", {"n": MAX_PROMPTS})
        return value
    raise PydanticCustomError("invalid_value", "prompt must be {forms}, none of them empty (token ids >= 0)",
                              {"forms": PROMPT_FORMS})


_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
Prompts = Annotated[list[str | list[int]], BeforeValidator(as_prompts),
                    WithJsonSchema({"anyOf": [{"type": "string"},
                                              {"type": "array", "items": {"type": "string"}, "minItems": 1,
                                               "maxItems": MAX_PROMPTS},
                                              _IDS,
                                              {"type": "array", "items": _IDS, "minItems": 1,
                                               "maxItems": MAX_PROMPTS}]})]


class Strict(BaseModel):
    """A field the server does not know is refused by name (a 400), never ignored: see unsupported.py."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: with include_usage, every chunk carries the usage so far

    def usage_in(self) -> tuple[bool, bool]:
        """(a final usage chunk, usage in every chunk)."""
        return self.include_usage, self.include_usage and self.continuous_usage_stats


class _Common(Strict):
    """Fields both endpoints share."""

    model: str
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat = Field(default=1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(default=1.0, gt=0.0, le=1.0)
    stop: Stops = None
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**64 - 1)    # what torch generators take
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # vLLM extensions
    repetition_penalty: StrictFloat = Field(default=1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    min_tokens: StrictInt = Field(default=0, ge=0)
    ignore_eos: StrictBool = False
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    # Strata extensions
    cache: CacheMode = "auto"
    cache_tags: list[str] = Field(default_factory=list)
    similar_note: StrictBool | None = None   # None = the server's setting

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        """OpenAI types these `X | null`, null meaning the default, and its client sends null for an argument given as
        None: read a null as absent (refused as a 400 before)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in NULL_IS_DEFAULT)}
        return data

    @field_validator("stream_options")
    @classmethod
    def _stream_options_only_when_streaming(cls, value, info: ValidationInfo):
        """Stream options on a whole answer would be ignored (OpenAI and vLLM refuse them too)."""
        if value is not None and not info.data.get("stream"):
            raise PydanticCustomError("invalid_value", "only allowed when stream is true")
        return value

    def answer_extensions(self) -> dict:
        """The extensions set away from their defaults: they change the answer, so they split the exact cache (a
        request that spells out repetition_penalty 1.0 still shares the plain request's entry)."""
        return self.model_dump(include=set(ANSWER_EXTENSIONS), exclude_defaults=True)


class TextPart(Strict):
    type: Literal["text"]
    text: str


_TEXT_PART = '{"type": "text", "text": "..."}'


def as_content(value):
    """A message's content as a string, a list of text parts or null, so that an error names `content` and says
    what is served, not a member of a union (an image part: this server's models read text only)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise PydanticCustomError("invalid_value", "part {i} is {kind}: content parts must be {form}; this "
                                          "model reads no images or audio", {"i": i, "form": _TEXT_PART, "kind": repr(
                                              kind) if kind and kind != "text" else "not a text part"})
        return value
    raise PydanticCustomError("invalid_value", "content must be a string or a list of text parts")


# Published without null: only an assistant's message may have none (ChatMessage checks the role).
Content = Annotated[str | list[TextPart] | None, BeforeValidator(as_content),
                    WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": {
                        "type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                        "required": ["type", "text"], "additionalProperties": False}}]})]


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Content = None
    name: str | None = None         # a participant's name: accepted, but the chat templates served here have no place for it
    # what the openai client's own assistant message carries when a conversation is sent back: null only
    refusal: NullOnly = None
    tool_calls: NullOnly = None
    function_call: NullOnly = None
    audio: NullOnly = None
    annotations: NullOnly = None

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        """Only an assistant's message may have no content (OpenAI's tool-call turns); a user's or a system's
        without any is a client's mistake, not an empty question."""
        if self.content is None and self.role != "assistant":
            raise PydanticCustomError("invalid_value", "a {role} message needs content (a string or text parts)",
                                      {"role": self.role})
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""


def plain_messages(messages: list[ChatMessage]) -> list[dict]:
    """Role and text of each message, as the chat template and the cache take them ("developer" is "system")."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: TopLogprobs | None = None
    response_format: ResponseFormat = None

    def requested_logprobs(self) -> int | None:
        """How many alternatives per token the engine returns (None: no logprobs). top_logprobs without logprobs
        is refused, as OpenAI does: the client would get none of what it asked for."""
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidParam("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return self.top_logprobs or 0

    def plain_messages(self) -> list[dict]:
        return plain_messages(self.messages)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def max_tokens_param(self) -> str:
        """The field that set the completion's length, for an error to name."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"


class CompletionRequest(_Common):
    prompt: Prompts
    max_tokens: StrictInt | None = Field(default=None, ge=0)    # 0 with echo: score the prompt, generate nothing
    logprobs: TopLogprobs | None = None     # the legacy form: how many alternatives per token
    echo: StrictBool | None = None
    best_of: BestOf = None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        """Echo with logprobs gives the prompt's tokens theirs too."""
        return self.logprobs if self.echo else None

    def max_tokens_param(self) -> str:
        return "max_tokens"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Shape:
    """Builds response bodies and stream chunks for one request, so chat and completions share the path."""

    __slots__ = ("chat", "id", "created", "model", "usage_null")

    def __init__(self, chat: bool, model: str, usage_null: bool = False):
        """usage_null: the stream ends with a usage chunk, so every other chunk says `"usage": null` (OpenAI's
        include_usage)."""
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.usage_null = usage_null

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def response(self, choices: list[tuple[str, str | None, dict | None]], usage_: dict,
                 strata: dict | list[dict]) -> dict:
        """choices: (text, finish_reason, logprobs) per choice, in index order."""
        if self.chat:
            body = self._envelope("chat.completion", [
                {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                 "finish_reason": finish_reason} for i, (text, finish_reason, logprobs) in enumerate(choices)])
        else:
            body = self._envelope("text_completion", [
                {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
                for i, (text, finish_reason, logprobs) in enumerate(choices)])
        return body | {"usage": usage_, "strata": strata}

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False,
              logprobs: dict | None = None, index: int = 0) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text} if text else {}
            chunk = self._envelope("chat.completion.chunk", [{"index": index, "delta": delta, "logprobs": logprobs,
                                                              "finish_reason": finish_reason}])
        else:
            chunk = self._envelope("text_completion", [{"index": index, "text": text, "logprobs": logprobs,
                                                        "finish_reason": finish_reason}])
        return chunk | {"usage": None} if self.usage_null else chunk

    def usage_chunk(self, usage_: dict) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", []) | {"usage": usage_}


def openapi_body(model: type[BaseModel]) -> dict:
    """An operation's requestBody for the OpenAPI document, with the model's $defs inlined: the routes read their
    bodies themselves (size cap, clear errors), so FastAPI would otherwise publish no body schema at all, and
    schema-driven clients and fuzzers (schemathesis) need one."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref is not None:
                return inline(defs[ref.rsplit("/", 1)[-1]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}
