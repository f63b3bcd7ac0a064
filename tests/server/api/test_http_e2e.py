"""End to end over real HTTP with the official openai client: one uvicorn server on 127.0.0.1 for the module,
the real default model, and all three cache layers as shipped. The semantic layer runs at --semantic-max-error 0.05:
at the default 0.02 the shipped calibration pairs certify no English threshold (tests/cache/request/
test_calibration.py), so no English paraphrase would hit. Each test makes the hits it checks for itself, so any one
of them runs alone or in any order."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile

import matplotlib.pyplot as plt
import pytest
from helpers.http_server import ADMIN, MODEL, admin, ask, client, default_semantic, start_server
from prometheus_client.parser import text_string_to_metric_families

from strata.server.api.serving import SIMILAR_NOTE

pytestmark = [pytest.mark.http, pytest.mark.slow]

NOTE_START = SIMILAR_NOTE.split("(")[0]
FRANCE = "What is the capital of France?"


@pytest.fixture(scope="module")
def server():
    with start_server(default_semantic(max_error=0.05)) as srv:
        yield srv


# The two helpers below ask as the other tenant, so the "miss first" assertions of the tests asking as acme hold
# whichever test ran before.
def exact_hit(server) -> None:
    """At least one exact hit, whatever ran before."""
    ask(server, FRANCE, key="key-globex")
    server.settle()
    assert ask(server, FRANCE, key="key-globex")[0] == "exact"


def semantic_hit(server) -> None:
    """At least one semantic hit, whatever ran before."""
    ask(server, "What is the largest ocean on Earth?", key="key-globex")
    server.settle()
    layer = ask(server, "Which ocean is the largest on Earth?", key="key-globex")[0]
    assert layer in ("semantic", "semantic-similar")


def test_chat_completion_miss_then_exact_hit(server):
    layer, _, first = ask(server, FRANCE)
    assert layer == "miss"
    text = first.choices[0].message.content
    assert text.strip() and first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.prompt_tokens > 5 and 0 < first.usage.completion_tokens <= 8
    assert first.model_extra["strata"]["cache"] == "miss"
    server.settle()
    layer, sim, second = ask(server, FRANCE)
    assert layer == "exact" and second.choices[0].message.content == text
    assert second.model_extra["strata"] == {"cache": "exact", "similarity": 1.0, "reason": "factual"}


def test_completion_endpoint(server):
    raw = client(server).completions.with_raw_response.create(model=MODEL, prompt="The sky is", max_tokens=8,
                                                              temperature=0)
    out = raw.parse()
    assert raw.headers["x-strata-cache"] == "miss"
    assert out.object == "text_completion" and out.choices[0].text.strip()
    assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"


def test_streaming_with_usage_and_cached_stream(server):
    messages = [{"role": "user", "content": "Name a primary color."}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
                  stream_options={"include_usage": True})
    results = []
    for _ in range(2):
        raw = client(server).chat.completions.with_raw_response.create(**kwargs)
        chunks = list(raw.parse())
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
        results.append((raw.headers["x-strata-cache"], text))
        server.settle()
    assert results[0][0] == "miss" and results[1][0] == "exact"     # a cached answer streams too
    assert results[0][1] == results[1][1] and results[0][1].strip()
    for _ in range(2):      # OpenAI: "all other chunks will also include a usage field, but with a null value"
        with server.http() as http:
            events = [json.loads(line[6:]) for line in http.post("/v1/chat/completions", json=kwargs).text.splitlines()
                      if line.startswith("data: {")]
        assert [e["usage"] is None for e in events] == [True] * (len(events) - 1) + [False]


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server):
    """vLLM's stream option (guidellm sends it): counts grow chunk by chunk up to the final usage, for a computed
    answer and for its cached replay alike."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name three fruits."}], max_tokens=12,
                  temperature=0, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    layers = []
    for _ in range(2):
        raw = client(server).chat.completions.with_raw_response.create(**kwargs)
        chunks = list(raw.parse())
        content = [c for c in chunks if c.choices and c.choices[0].delta.content]
        counts = [c.usage.completion_tokens for c in content]
        assert content and counts == sorted(counts) and counts[-1] == chunks[-1].usage.completion_tokens > 0
        assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in content)
        layers.append(raw.headers["x-strata-cache"])
        server.settle()
    assert layers == ["miss", "exact"]


def test_paraphrase_is_a_semantic_hit(server):
    """The shipped semantic layer (real embedder, cross-encoder, certified tiers) serves a close paraphrase, marked
    as an answer to a similar question where only the similar tier is certified."""
    ask(server, "What is the largest ocean on Earth?")
    server.settle()
    layer, sim, out = ask(server, "Which ocean is the largest on Earth?")
    assert layer in ("semantic", "semantic-similar")
    assert 0.9 < float(sim) <= 1.0
    assert out.model_extra["strata"]["similarity"] == pytest.approx(float(sim), abs=1e-4)
    assert out.choices[0].message.content.startswith(NOTE_START) == (layer == "semantic-similar")


# At 0.05 English is served from 6.142 (logit + cosine; docs/semantic-quality.md): since thresholds are tested from
# the top down (the 95% then holds for the one chosen), 5.859 before. These paraphrases score 5.90 - 6.19: the last
# three miss now, and are strict expected failures, so a change that makes them hit shows.
MISSES_AT_005 = pytest.mark.xfail(strict=True, reason="scores below the 0.05 threshold of 6.142")


@pytest.mark.parametrize("cached, paraphrase", [
    ("How many days are in a leap year?", "How many days in a leap year?"),
    ("What is the tallest mountain in the world?", "Which mountain is the tallest in the world?"),
    pytest.param("How do I boil an egg?", "What's the way to boil an egg?", marks=MISSES_AT_005),
    pytest.param("What is the speed of light?", "How fast does light travel?", marks=MISSES_AT_005),
    pytest.param("What is the boiling point of water at sea level?",
                 "At sea level, what temperature does water boil at?", marks=MISSES_AT_005),
])
def test_english_paraphrases_hit(server, cached, paraphrase):
    assert ask(server, cached)[0] == "miss"
    server.settle()
    assert ask(server, paraphrase)[0] in ("semantic", "semantic-similar")


# The reversals score like paraphrases under the model alone (6.01, 6.12): the transposition rule rules them out.
@pytest.mark.parametrize("cached, other", [
    ("How many kilograms is one pound?", "How many pounds is one kilogram?"),
    ("Convert 5 lb to kg", "Convert 5 kg to lb"),
    ("What is the capital of Spain?", "What is the capital of Portugal?"),
])
def test_a_near_miss_question_is_not_served_from_its_twin(server, cached, other):
    ask(server, cached)
    server.settle()
    assert ask(server, other)[0] == "miss"


def test_realtime_question_bypasses_both_times(server):
    for _ in range(2):
        layer, _, out = ask(server, "What is the weather in Paris right now?")
        assert layer == "bypass" and out.model_extra["strata"]["reason"] == "realtime"
        server.settle()


def test_tenants_do_not_share_answers(server):
    question = "Who wrote Hamlet?"
    assert ask(server, question, key="key-acme")[0] == "miss"
    server.settle()
    assert ask(server, question, key="key-globex")[0] == "miss"
    server.settle()
    assert ask(server, question, key="key-acme")[0] == "exact"


def test_invalidate_by_tag_then_miss(server):
    question = "How tall is Mount Everest?"
    ask(server, question, extra_body={"cache_tags": ["geography"]})
    server.settle()
    assert ask(server, question)[0] == "exact"
    assert admin(server, "/admin/cache/invalidate", json={"tag": "geography"}).json() == {"deleted": 1}
    assert ask(server, question)[0] == "miss"


def test_invalidate_similar_to_query(server):
    question = "Who painted the Mona Lisa?"
    ask(server, question)
    server.settle()
    body = {"similar_to": "who painted the mona lisa", "min_similarity": 0.9, "tenant": "acme"}
    assert admin(server, "/admin/cache/invalidate", json=body).json()["deleted"] >= 1
    assert ask(server, question)[0] == "miss"


def test_cache_control_and_body_modes(server):
    q1, q2 = "What colour is a ripe banana?", "What is the largest planet?"
    assert ask(server, q1, extra_headers={"Cache-Control": "no-store"})[0] == "bypass"
    server.settle()
    assert ask(server, q1)[0] == "miss"                  # no-store wrote nothing
    assert ask(server, q2, extra_headers={"Cache-Control": "no-cache"})[0] == "bypass"
    server.settle()
    assert ask(server, q2)[0] == "exact"                 # no-cache skipped the lookup but wrote
    assert ask(server, q2, extra_body={"cache": "off"})[0] == "bypass"
    assert ask(server, "what is the largest planet", extra_body={"cache": "exact-only"})[0] == "miss"


def test_warmup_then_exact_hit(server):
    faq = '{"question": "What are your opening hours?", "answer": "We are open 9 to 5.", "tags": ["faq"]}\n'
    res = admin(server, "/admin/cache/warmup?tenant=acme&max_tokens=8", content=faq)
    assert res.status_code == 200 and res.json() == {"written": 1, "records": 1}
    layer, _, out = ask(server, "What are your opening hours?")
    assert layer == "exact" and out.choices[0].message.content == "We are open 9 to 5."


def test_admin_input_no_request_may_hold_is_a_400_and_no_store_fault(server):
    """Lone surrogates, types the cache cannot key by, deep nesting and oversized bodies: a 400 / 413 naming the
    problem, never a 500, and the store sees nothing (so /health stays ok)."""
    before = admin(server, "/admin/cache/stats").json()["request_cache"]
    checks = [
        ("/admin/cache/invalidate", {"content": b'{"tag": "\\ud800"}'}, 400, "invalid_value"),
        ("/admin/cache/invalidate", {"content": b'{"similar_to": "\\ud800"}'}, 400, "invalid_value"),
        ("/admin/cache/invalidate", {"json": {"similar_to": "x" * 5000}}, 400, "invalid_value"),
        ("/admin/cache/invalidate", {"content": b'{"tag": '}, 400, "invalid_json"),
        ("/admin/cache/invalidate", {"json": {"tag": "y" * (2 << 20)}}, 413, "request_too_large"),
        ("/admin/cache/warmup", {"content": b'{"question": "q", "answer": "bad \\ud800"}\n'}, 400, "invalid_value"),
        ("/admin/cache/warmup", {"content": b'{"question": "q", "answer": "a", "ttl_class": ["a"]}\n'}, 400,
         "invalid_value"),
        ("/admin/cache/warmup", {"content": b'{"question": "q", "answer": \n'}, 400, "invalid_value"),
        ("/admin/cache/warmup?max_tokens=0", {"content": b'{"question": "q", "answer": "a"}\n'}, 400, None),
        ("/admin/cache/warmup?temperature=nan", {"content": b'{"question": "q", "answer": "a"}\n'}, 400, None),
        ("/admin/cache/warmup", {"content": b'{"question": "q", "answer": "a", "tags": ' + b"[" * 3000 + b"\n"},
         400, None),
    ]
    for path, body, status, code in checks:
        res = admin(server, path, **body)
        assert res.status_code == status, (path, body, res.text[:300])
        if code:
            assert res.json()["error"]["code"] == code, res.text[:300]
    after = admin(server, "/admin/cache/stats").json()["request_cache"]
    assert after["write_queue"]["errors"] == before["write_queue"]["errors"]
    with server.http(None) as http:
        assert http.get("/health").json()["status"] == "ok"
        big = http.post("/admin/cache/invalidate", content=b"{" + b" " * (8 << 20) + b"}")
        assert big.status_code == 401            # the token is checked before the body is read


def test_admin_stats_models_health(server):
    exact_hit(server)
    stats = admin(server, "/admin/cache/stats").json()
    assert stats["request_cache"]["counters"]["exact"]["hit"] >= 1 and "kv_blocks_used" in stats["engine"]
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    with server.http(None) as http:
        assert http.get("/health").json()["status"] == "ok"


def test_metrics_parse_and_carry_families(server):
    exact_hit(server)
    semantic_hit(server)
    assert ask(server, "What is the weather in Paris right now?", key="key-globex")[0] == "bypass"
    with server.http(None) as http:         # API keys are on: metrics and status data need the admin token
        assert http.get("/metrics").status_code == 401 and http.get("/status").status_code == 401
    with server.http("key-acme") as http:
        assert http.get("/metrics").status_code == 403
    with server.http(ADMIN) as http:
        text = http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("strata_requests", "strata_request_latency_seconds", "strata_time_to_first_token_seconds",
                 "strata_time_per_output_token_seconds", "strata_tokens_per_second", "strata_kv_blocks",
                 "strata_kv_swap_blocks", "strata_preemptions", "strata_prefix_cache_hits",
                 "strata_request_cache_hits", "strata_request_cache_similarity"):
        assert name in families, name
    hits = {s.labels["layer"]: s.value for s in families["strata_request_cache_hits"].samples
            if s.name.endswith("_total")}
    assert hits["exact"] >= 1 and hits["semantic"] + hits["semantic-similar"] >= 1
    latency = {s.labels["cache_layer"] for s in families["strata_request_latency_seconds"].samples}
    assert {"exact", "miss", "bypass"} <= latency
    kv = {s.labels["state"]: s.value for s in families["strata_kv_blocks"].samples}
    assert kv["total"] == server.stats()["kv_blocks_total"] and kv["used"] + kv["free"] == kv["total"]
    sim_count = [s.value for s in families["strata_request_cache_similarity"].samples if s.name.endswith("_count")]
    assert sim_count[0] >= 1
    served = {s.labels["language"]: s.value for s in families["strata_semantic_language_served"].samples}
    report = server.cache.stats()["semantic"]["languages"]
    assert served == {lang: float(what["similar"] is not None) for lang, what in report.items()} and served["en"] == 1
    cuts = {(s.labels["language"], s.labels["tier"]): s.value for s in families["strata_semantic_threshold"].samples}
    assert cuts[("en", "similar")] == pytest.approx(report["en"]["similar"])


CHROMIUM = shutil.which("chromium")


def chromium(url: str, *args: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                               "--no-first-run", "--disable-background-networking", "--disable-component-update",
                               "--disable-sync", f"--user-data-dir={profile}", "--virtual-time-budget=5000",
                               "--window-size=1200,900", *args, url],
                              capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(CHROMIUM is None, reason="headless test of the status page needs Debian's chromium "
                                             "(apt-get install -y chromium)")
def test_status_page_in_headless_chromium(server, tmp_path):
    exact_hit(server)                    # at least one exact hit to show
    dom = chromium(server.url + f"/#token={ADMIN}", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout

    def cell(id_: str) -> str:
        return re.search(rf'id="{id_}"[^>]*>([^<]*)<', html).group(1)

    assert cell("model").startswith(MODEL + "@")               # JS replaced the "…" placeholders
    assert int(cell("kv-total")) == server.stats()["kv_blocks_total"]
    exact = re.search(r"<td>exact</td><td>(\d+)</td>", html)
    assert exact and int(exact.group(1)) >= 1
    assert re.search(r"<td>chat</td><td>exact</td>", html)   # recent requests with their layer
    assert cell("health") == "health ok"
    server.cache.faults.report("write", OSError("disk full"))   # what /health calls degraded, the page shows too
    try:
        shown = re.search(r'id="health"[^>]*>([^<]*)<', chromium(server.url + f"/#token={ADMIN}", "--dump-dom").stdout)
        assert shown.group(1).startswith("health degraded: request cache:") and "disk full" in shown.group(1)
    finally:
        server.cache.faults.resolved()
    shot = tmp_path / "status.png"
    res = chromium(server.url + f"/#token={ADMIN}", f"--screenshot={shot}")
    assert res.returncode == 0 and shot.stat().st_size > 10_000, res.stderr[-2000:]
    pixels = plt.imread(shot)
    assert pixels.shape[:2] == (900, 1200) and pixels.std() > 0.05    # not a blank page
