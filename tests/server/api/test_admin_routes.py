"""Admin routes do their blocking work (embedding, store writes and deletes, parsing) off the event loop."""
import asyncio
import json
import logging
import time
from types import SimpleNamespace

import httpx
from fastapi import FastAPI

from strata.cache.request.calibration import Tiers
from strata.cache.request.embedders import HashEmbedder
from strata.cache.request.request_cache import RequestCache, RequestCacheConfig
from strata.cache.request.semantic import SemanticCache
from strata.server.api import errors
from strata.server.api.admin import admin_router
from strata.server.api.auth import Auth
from strata.server.api.config import ServerConfig


class SlowEmbedder(HashEmbedder):
    """Each embedding takes 150 ms, as a real model on a busy CPU may."""

    def encode(self, texts):
        time.sleep(0.15)
        return super().encode(texts)


def test_invalidate_and_warmup_never_block_the_event_loop(tmp_path, caplog):
    cache = RequestCache(RequestCacheConfig(db=str(tmp_path / "c.db")),
                         semantic=SemanticCache(SlowEmbedder(), Tiers(serve=0.95, similar=0.85)))
    app = FastAPI()
    errors.install(app)
    app.include_router(admin_router(Auth(None, "tok"), SimpleNamespace(cache=cache, model_key="m@1", config=ServerConfig()), 1 << 20))
    faq = "\n".join(json.dumps({"question": f"How do I open account type {i}?", "answer": f"Form {i}."})
                    for i in range(3)).encode()

    async def go():
        asyncio.get_running_loop().slow_callback_duration = 0.1
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://admin",
                                     headers={"Authorization": "Bearer tok"}) as http:
            warm = await http.post("/admin/cache/warmup", content=faq)
            gone = await http.post("/admin/cache/invalidate", json={"similar_to": "How do I open account type 1?",
                                                                     "min_similarity": 0.99})
            bad = await http.post("/admin/cache/warmup", content=b'{"question": "q"}\nnot json\n')
            put, cache.store.put = cache.store.put, full_disk
            try:
                failed = await http.post("/admin/cache/warmup", content=faq)
            finally:
                cache.store.put = put
        return warm, gone, bad, failed

    def full_disk(entry):
        raise OSError(28, "No space left on device")

    with caplog.at_level(logging.WARNING, logger="asyncio"):
        warm, gone, bad, failed = asyncio.run(go(), debug=True)
    assert warm.json() == {"written": 3, "records": 3} and gone.json() == {"deleted": 1}
    assert failed.status_code == 503 and failed.json()["error"]["code"] == "store_unavailable"    # was 200
    assert failed.json()["error"]["message"].startswith("0 of 3 records written; the store failed (write: OSError")
    assert bad.status_code == 400 and "line 2" in bad.json()["error"]["message"]
    slow = [r.getMessage() for r in caplog.records if "took" in r.getMessage()]
    assert not slow, slow
    cache.close()


def test_warmup_lines_split_at_newlines_only():
    """An answer holding U+2028 unescaped (json.dumps with ensure_ascii=False writes it so) is one line of JSON:
    splitlines cut it in two and the warm-up was refused as 'Unterminated string'. CRLF lines still parse."""
    from strata.server.api.admin import _jsonl_records

    body = (json.dumps({"question": "q", "answer": "line one\u2028line two\u0085three"}, ensure_ascii=False) + "\r\n"
            + json.dumps({"question": "q2", "answer": "a"}) + "\n").encode()
    assert _jsonl_records(body) == [{"question": "q", "answer": "line one\u2028line two\u0085three"},
                                    {"question": "q2", "answer": "a"}]
