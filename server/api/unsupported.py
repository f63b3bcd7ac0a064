"""OpenAI request fields this server does not honour: a client that relies on one gets a 400 naming it, never an
answer that silently ignored it (a benchmark scoring tool calls would measure nothing)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict
from pydantic_core import PydanticCustomError

ERROR_TYPE = "unsupported_parameter"

# Fields refused whatever their value (they are not in the published schema); the text says why.
REFUSED = {
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "parallel_tool_calls": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "logit_bias": "logit_bias is not supported",
    "suffix": "insertion (a suffix after the completion) is not supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "this model does not reason in a separate channel",
    "web_search_options": "web search is not supported",
}


def refusal(field: str) -> tuple[str, str]:
    """(message, code) for a field the request model does not know: a refused OpenAI field, or an unknown one."""
    if field in REFUSED:
        return f"'{field}' is not supported by this server: {REFUSED[field]}", ERROR_TYPE
    return f"Unknown parameter: '{field}'.", "unknown_parameter"


def only(why: str, *allowed: Any) -> BeforeValidator:
    """A field accepted only at values that change nothing (null, false, a default), refused with `why` otherwise:
    clients that send the default explicitly keep working."""

    def check(value: Any) -> Any:
        if value is not None and not any(value == a and type(value) is type(a) for a in allowed):
            raise PydanticCustomError(ERROR_TYPE, why)
        return value

    return BeforeValidator(check)


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]


BestOf = Annotated[Literal[1] | None, only("best_of is not supported (only 1 or null)", 1)]
ResponseFormat = Annotated[TextFormat | None, only("only the text response format is supported (no JSON mode or "
                                                   "JSON schema)", {"type": "text"})]
NullOnly = Annotated[None, only("only null is supported here (no tool calls, function calls, audio or annotations)")]
