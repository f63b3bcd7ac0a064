"""Generated input: schemathesis reads the app's OpenAPI document (which publishes the request bodies) and sends
bodies built from it, and from mutations of it (wrong types, missing fields, out-of-range values); nothing may end
in a 5xx. The server runs a tiny model with the real tokenizer, so the whole request path runs at fuzzing speed."""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from strata.cache.request.calibration import Tiers
from strata.cache.request.embedders import HashEmbedder
from strata.cache.request.request_cache import RequestCache, RequestCacheConfig
from strata.cache.request.semantic import SemanticCache
from strata.server.api.app import create_app
from strata.server.api.auth import Auth
from strata.server.api.config import ServerConfig
from strata.server.api.server import serve_in_thread
from strata.server.engine.config import EngineConfig
from strata.server.engine.engine_client import EngineClient

pytestmark = [pytest.mark.http, pytest.mark.slow]


@pytest.fixture(scope="module")
def served_app(tiny_chat_model_dir):
    engine = EngineClient(EngineConfig(model=str(tiny_chat_model_dir), dtype="fp32", kv_cache_memory="64MiB",
                                       max_model_len=256, num_threads=1))
    engine.start()
    engine.wait_ready()
    cache = RequestCache(RequestCacheConfig(), semantic=SemanticCache(HashEmbedder(), Tiers(serve=0.95, similar=0.85)))
    app = create_app(engine, cache, auth=Auth(), config=ServerConfig(default_max_tokens=8))
    with serve_in_thread(app) as url:     # real HTTP: an in-process ASGI transport would run the app's shutdown
        yield url, engine.info.model_id
    engine.stop()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"])
@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
def test_no_generated_body_gets_a_server_error(served_app, path, mode):
    url, model = served_app
    operation = schemathesis.openapi.from_url(url + "/openapi.json")[path]["POST"]
    seen = {"engine": 0}

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def send(case):
        if isinstance(case.body, dict) and "model" in case.body and hash(repr(case.body)) % 2:
            case.body["model"] = model        # half the bodies name the served model, so they reach the engine
        response = case.call()
        seen["engine"] += response.status_code == 200
        assert response.status_code < 500, (response.status_code, case.body, response.text[:300])

    send()
    if mode is schemathesis.GenerationMode.POSITIVE:
        assert seen["engine"] > 0            # the run reached the engine, not only the validators
