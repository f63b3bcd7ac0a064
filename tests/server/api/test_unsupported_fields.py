"""Fields the server does not honour are refused by name, never ignored; the no-op values clients send by default
still pass."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from strata.server.api.errors import invalid
from strata.server.api.protocol import ChatCompletionRequest, CompletionRequest
from strata.server.api.unsupported import REFUSED
from strata.server.engine.sampling_params import InvalidParam

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def refusal(kind, body: dict):
    with pytest.raises(ValidationError) as info:
        kind.model_validate(body)
    err = invalid(info.value)
    assert err.status == 400
    return err


@pytest.mark.parametrize("field", sorted(REFUSED))
@pytest.mark.parametrize("kind,body", [(ChatCompletionRequest, CHAT), (CompletionRequest, COMPLETION)])
def test_refused_fields_are_named_whatever_their_value(kind, body, field):
    err = refusal(kind, body | {field: None})
    assert (err.param, err.code) == (field, "unsupported_parameter")
    assert field in err.message and REFUSED[field] in err.message


@pytest.mark.parametrize("kind,body,field,value", [
    (ChatCompletionRequest, CHAT, "response_format", {"type": "json_object"}),
    (ChatCompletionRequest, CHAT, "response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
    (CompletionRequest, COMPLETION, "best_of", 2),
])
def test_fields_that_would_change_the_answer_are_refused(kind, body, field, value):
    err = refusal(kind, body | {field: value})
    assert (err.param, err.code) == (field, "unsupported_parameter")


@pytest.mark.parametrize("kind,body,extra", [
    (ChatCompletionRequest, CHAT, {"logprobs": False, "top_logprobs": 0, "response_format": {"type": "text"}}),
    (ChatCompletionRequest, CHAT, {"logprobs": None, "top_logprobs": None, "response_format": None}),
    (CompletionRequest, COMPLETION, {"logprobs": None, "echo": False, "best_of": 1}),
])
def test_no_op_values_pass(kind, body, extra):
    kind.model_validate(body | extra)


@pytest.mark.parametrize("kind,body,field,value", [
    (ChatCompletionRequest, CHAT, "top_logprobs", 21),
    (ChatCompletionRequest, CHAT, "top_logprobs", -1),
    (ChatCompletionRequest, CHAT, "logprobs", 1),
    (CompletionRequest, COMPLETION, "logprobs", 21),
    (CompletionRequest, COMPLETION, "logprobs", True),
])
def test_logprobs_out_of_range_are_named(kind, body, field, value):
    assert refusal(kind, body | {field: value}).param == field


def test_top_logprobs_without_logprobs_is_refused():
    req = ChatCompletionRequest.model_validate(CHAT | {"top_logprobs": 2})
    with pytest.raises(InvalidParam) as err:
        req.requested_logprobs()
    assert err.value.param == "top_logprobs"
    assert ChatCompletionRequest.model_validate(CHAT | {"logprobs": True, "top_logprobs": 2}).requested_logprobs() == 2


@pytest.mark.parametrize("kind,body,patch,param", [
    (ChatCompletionRequest, CHAT, {"frobnicate": 1}, "frobnicate"),
    (CompletionRequest, COMPLETION, {"tempreature": 0}, "tempreature"),
    (ChatCompletionRequest, CHAT, {"messages": [{"role": "user", "content": "x", "nickname": "bob"}]},
     "messages.0.nickname"),
    (ChatCompletionRequest, CHAT, {"stream_options": {"include_usage": True, "chunk": 1}}, "stream_options.chunk"),
    (ChatCompletionRequest, CHAT, {"suffix": "x"}, "suffix"),
])
def test_unknown_fields_are_named(kind, body, patch, param):
    err = refusal(kind, body | patch)
    assert err.param == param and param in err.message
    assert err.code == ("unsupported_parameter" if param in REFUSED else "unknown_parameter")


def test_a_conversation_sent_back_as_the_openai_client_returned_it_passes():
    """The client's assistant message, dumped as is (null refusal, tool calls, ...), and a participant name."""
    assistant = {"role": "assistant", "content": "Paris.", "refusal": None, "tool_calls": None, "function_call": None,
                 "audio": None, "annotations": None}
    req = ChatCompletionRequest.model_validate(CHAT | {"messages": [
        {"role": "user", "content": "Capital of France?", "name": "ann"}, assistant,
        {"role": "user", "content": "And of Spain?"}]})
    assert [m["role"] for m in req.plain_messages()] == ["user", "assistant", "user"]
    err = refusal(ChatCompletionRequest, CHAT | {"messages": [assistant | {"tool_calls": [{"id": "1"}]}]})
    assert (err.param, err.code) == ("messages.0.tool_calls", "unsupported_parameter")


def test_published_schema_forbids_unknown_fields():
    """Schema-driven clients and fuzzers see the same rule the server applies."""
    for kind in (ChatCompletionRequest, CompletionRequest):
        assert kind.model_json_schema()["additionalProperties"] is False
