"""Every bad input gets OpenAI's error shape and the right status; afterwards the server answers and no KV
block leaks (also when a client disconnects mid-stream)."""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import httpx
import openai
import pytest
from helpers.http_server import ADMIN, MODEL
from prometheus_client.parser import text_string_to_metric_families

from strata.server.api.serving import shared_failure
from strata.server.engine.engine_client import EngineRequestFailed
from strata.server.engine.input_processor import RequestError

pytestmark = [pytest.mark.http, pytest.mark.slow]

CHAT = "/v1/chat/completions"


@pytest.fixture(autouse=True)
def still_healthy(server):
    """After each test: the server still answers a real request and every KV block is back."""
    yield
    assert server.idle_blocks(server.idle) == server.idle
    with server.http() as http:
        res = http.post(CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}],
                                    "max_tokens": 2, "temperature": 0})
    assert res.status_code == 200, res.text


def error_of(res, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert res.status_code == status, res.text
    err = res.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def chat(server, key: str | None = "key-acme", **body):
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4} | body
    with server.http(key) as http:
        return http.post(CHAT, json=payload)


def test_malformed_json(server):
    with server.http() as http:
        res = http.post(CHAT, content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"})
    error_of(res, 400, "invalid_json")


def test_body_not_an_object(server):
    with server.http() as http:
        error_of(http.post(CHAT, json=[1, 2]), 400, "invalid_json")


def test_missing_field(server):
    with server.http() as http:
        error_of(http.post(CHAT, json={"model": MODEL}), 400, "missing_required_parameter", "messages")


@pytest.mark.parametrize("field,value,param", [
    ("max_tokens", "ten", "max_tokens"),
    ("temperature", "hot", "temperature"),
    ("messages", "hello", "messages"),
    ("stream", "yes", "stream"),
    ("cache", "sometimes", "cache"),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages.0.content"),
    ("messages", [{"role": "user", "content": 7}], "messages.0.content"),
    ("messages", [{"role": "user", "content": None}], "messages.0"),
    ("messages", [{"role": "system"}, {"role": "user", "content": "Hi"}], "messages.0"),
])
def test_wrong_types(server, field, value, param):
    error_of(chat(server, **{field: value}), 400, "invalid_value", param)


def test_wrong_role_names_the_message(server):
    err = error_of(chat(server, messages=[{"role": "robot", "content": "x"}]), 400)
    assert err["param"].startswith("messages.0.role")


def test_unknown_model_via_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="key-acme", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "model_not_found" and info.value.param == "model"
    assert info.value.type == "invalid_request_error"          # OpenAI's type for it (audit 11: not_found_error)


def test_context_length_exceeded(server):
    long_text = "word " * (server.inputs.info.max_model_len + 10)
    error_of(chat(server, messages=[{"role": "user", "content": long_text}]), 400, "context_length_exceeded",
             "messages")
    with server.http() as http:
        res = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi there", "max_tokens":
                                                 server.inputs.info.max_model_len - 1})
    error_of(res, 400, "context_length_exceeded", "prompt")


@pytest.mark.parametrize("max_tokens,code", [(0, "invalid_value"), (-3, "invalid_value"), (10**6, "invalid_value")])
def test_max_tokens_out_of_range(server, max_tokens, code):
    error_of(chat(server, max_tokens=max_tokens), 400, code, "max_tokens")


def test_bad_auth(server):
    error_of(chat(server, key=None), 401, "invalid_api_key")
    error_of(chat(server, key="stolen"), 401, "invalid_api_key")
    with server.http(None) as http:
        error_of(http.get("/admin/cache/stats"), 401)
    with server.http("key-acme") as http:       # a tenant key is not the admin token
        error_of(http.get("/admin/cache/stats"), 403, "forbidden")


def test_oversize_body(server):
    limit = server.app.state.config.max_body_bytes
    with server.http() as http:
        res = http.post(CHAT, content=json.dumps({"model": MODEL, "messages": [
            {"role": "user", "content": "x" * (limit + 1)}]}), headers={"content-type": "application/json"})
    error_of(res, 413, "request_too_large")

    def chunks():                               # no Content-Length: the cap applies while reading
        yield b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "'
        for _ in range(limit // 65536 + 1):
            yield b"x" * 65536
        yield b'"}]}'

    with server.http() as http:
        error_of(http.post(CHAT, content=chunks(), headers={"content-type": "application/json"}), 413,
                 "request_too_large")


def test_overload_answers_503_with_retry_after_but_hits_still_serve(server):
    question = {"messages": [{"role": "user", "content": "What is two plus two?"}], "temperature": 0}
    assert chat(server, **question).status_code == 200
    server.settle()
    settings = server.app.state.config
    saved, settings.max_queue = settings.max_queue, 0
    try:
        res = chat(server, messages=[{"role": "user", "content": "Tell me about owls."}], temperature=0)
        error_of(res, 503, "overloaded")
        assert res.headers["retry-after"] == "1"
        hit = chat(server, **question)
        assert hit.status_code == 200 and hit.headers["x-strata-cache"] == "exact"
    finally:
        settings.max_queue = saved


def test_max_queue_holds_for_requests_that_arrive_together(server):
    """Misses arriving in one burst each count from admission, not from when the engine first reads them."""
    settings = server.app.state.config
    saved, settings.max_queue = settings.max_queue, 3

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120, headers={  # each one computed, none shared
                "Authorization": "Bearer key-acme", "Cache-Control": "no-store"}) as http:
            bodies = [{"model": MODEL, "messages": [{"role": "user", "content": f"Tell me a story about owl {i}."}],
                       "max_tokens": 48, "temperature": 0, "ignore_eos": True} for i in range(12)]
            return [r.status_code for r in await asyncio.gather(*(http.post(CHAT, json=b) for b in bodies))]

    try:
        codes = asyncio.run(burst())
    finally:
        settings.max_queue = saved
    assert sorted(codes) == [200] * 3 + [503] * 9, codes
    assert server.app.state.completer.admitted == 0


def test_wrong_method_token_ids_outside_the_vocabulary_and_health_probes(server):
    with server.http() as http:
        error_of(http.get(CHAT), 405)
        assert http.get(CHAT).json()["error"]["type"] == "invalid_request_error"      # the client's mistake
        error_of(http.post("/v1/completions", json={"model": MODEL, "prompt": [10**9], "max_tokens": 1}), 400,
                 "invalid_value", "prompt")
        assert http.head("/health").status_code == 200


def test_n_over_the_choice_limit_is_refused(server):
    error_of(chat(server, n=65), 400, "invalid_value", "n")


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    with server.http() as http, http.stream("POST", CHAT, json=body) as res:
        assert res.status_code == 200
        lines = res.iter_lines()
        seen = [next(lines) for _ in range(6)]
        assert any('"content"' in line for line in seen)
        assert server.stats()["kv_blocks_used"] > server.idle     # the sequence holds blocks now
    assert server.idle_blocks(server.idle) == server.idle
    assert server.app.state.completer.engine.num_pending == 0


def abandoned(server) -> float:
    """strata_requests_total of chat answers whose client left (status 499)."""
    with server.http(ADMIN) as http:
        families = text_string_to_metric_families(http.get("/metrics").text)
    return sum(s.value for f in families if f.name == "strata_requests" for s in f.samples
               if s.name == "strata_requests_total" and s.labels["status"] == "499")


def test_a_client_that_leaves_while_its_body_is_read_counts_as_left_not_as_an_incident(server, caplog):
    """Cut short in the body (a client timeout or cancel): a 499 in /metrics, no error and no traceback in the log
    (it was a 500 "unexpected error" with two tracebacks)."""
    left = abandoned(server)
    host, port = server.url.removeprefix("http://").split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-acme\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n" + b'{"model": "' + b"x" * 90)
            time.sleep(0.2)
    deadline = time.monotonic() + 10
    while abandoned(server) < left + 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert abandoned(server) == left + 3
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_disconnect_while_waiting_for_a_whole_answer_aborts_and_frees_blocks(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long essay about rivers."}],
            "max_tokens": 400, "temperature": 0}
    before = server.stats()["generated_tokens"]
    left = abandoned(server)
    with server.http() as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post(CHAT, json=body, timeout=httpx.Timeout(120, read=1.5))  # the client gives up and hangs up
    engine = server.app.state.completer.engine
    deadline = time.monotonic() + 10.0      # the server notices within its 0.2 s poll; longer on a loaded machine,
    while engine.num_pending and time.monotonic() < deadline:   # where the request may not have reached the engine
        time.sleep(0.05)                                         # when the client left
    assert engine.num_pending == 0
    assert server.idle_blocks(server.idle, timeout=5.0) == server.idle
    assert abandoned(server) == left + 1            # counted as a client that left (499), as a stream's is
    assert server.stats()["generated_tokens"] - before < 400  # stopped early, not run to max_tokens


@pytest.mark.parametrize("call,param,code", [
    (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                         tools=[{"type": "function", "function": {"name": "weather"}}]),
     "tools", "unsupported_parameter"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                         response_format={"type": "json_object"}),
     "response_format", "unsupported_parameter"),
    (lambda c: c.completions.create(model=MODEL, prompt="def f():", suffix="return 1"), "suffix",
     "unsupported_parameter"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                         extra_body={"mirostat": 2}), "mirostat", "unknown_parameter"),
    (lambda c: c.completions.create(model=MODEL, prompt="Hi", stream_options={"include_usage": True}),
     "stream_options", "invalid_value"),     # a whole answer would ignore them
])
def test_unsupported_fields_are_refused_by_name_via_openai_client(server, call, param, code):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="key-acme", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        call(client)
    assert (info.value.param, info.value.code) == (param, code)
    assert param in info.value.message


def test_no_op_values_of_unsupported_fields_are_answered(server):
    res = chat(server, logprobs=False, response_format={"type": "text"}, temperature=0)
    assert res.status_code == 200, res.text


def test_followers_of_a_failed_computation_get_its_error_not_an_internal_one():
    """Single-flight followers (and repeats within the negative TTL) get the error their leader got: a 500
    engine_error, not "internal error (incident ...)", each a fresh exception (one raised in many tasks grows its
    traceback)."""
    failed = EngineRequestFailed("IndexError: index out of range")
    first, second = shared_failure(failed), shared_failure(failed)
    assert first is not second
    assert (first.status, first.code) == (500, "engine_error") and "IndexError" in first.message
    assert shared_failure(RequestError("the prompt is empty")).status == 400
    assert (shared_failure(RuntimeError("x")).status, shared_failure(RuntimeError("x")).code) == (500, "internal_error")

