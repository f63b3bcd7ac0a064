"""Model-based test: against a plain dict, the cache never serves a wrong, foreign, invalidated or expired answer."""
import asyncio
import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from strata.cache.request.request_cache import CacheRequest, RequestCache, RequestCacheConfig

TENANTS = ("acme", "globex")
QUESTIONS = tuple(f"Explain sorting algorithm number {i}" for i in range(4))   # "explain": conceptual, 30 days


class Clock:
    def __init__(self):
        self.t = 1_000_000.0

    def __call__(self):
        return self.t


def chat(tenant, question, history=None):
    messages = ([{"role": "user", "content": history}, {"role": "assistant", "content": "ok"}] if history else [])
    return CacheRequest(tenant, "m@1", [*messages, {"role": "user", "content": question}], {"temperature": 0})


class CacheVersusDict(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.clock = Clock()
        self.cache = RequestCache(RequestCacheConfig(), clock=self.clock, rng=random.Random(0))
        self.model: dict[tuple, str] = {}        # live answers
        self.stored: set[tuple] = set()           # written and not invalidated (expired ones may linger until purged)
        self.version = 0

    def ask(self, key):
        async def go():
            lookup = await self.cache.lookup(chat(*key))
            return lookup

        return asyncio.run(go())

    @rule(tenant=st.sampled_from(TENANTS), question=st.sampled_from(QUESTIONS),
          history=st.sampled_from([None, "Talk about databases"]))
    def ask_and_answer(self, tenant, question, history):
        key = (tenant, question, history)
        lookup = self.ask(key)
        if key in self.model:
            assert lookup.hit is not None and lookup.hit.text == self.model[key], (key, lookup)
            return
        assert lookup.hit is None, (key, lookup)
        self.version += 1
        answer = f"answer {self.version} for {tenant}"
        lookup.complete(answer)
        asyncio.run(self.cache.drain())
        self.model[key] = answer
        self.stored.add(key)

    @rule(tenant=st.sampled_from(TENANTS))
    def invalidate_tenant(self, tenant):
        gone = self.cache.invalidate(tenant=tenant)
        assert sum(k[0] == tenant for k in self.model) <= gone <= sum(k[0] == tenant for k in self.stored)
        self.model = {k: v for k, v in self.model.items() if k[0] != tenant}
        self.stored = {k for k in self.stored if k[0] != tenant}

    @rule()
    def expire_everything(self):
        self.clock.t += 40 * 86400          # past 30 days + jitter
        self.model.clear()

    @invariant()
    def store_matches_model(self):
        live = [e for e in self.cache.store.entries() if e.expires_at > self.clock.t]
        assert len(live) == len(self.model)

    def teardown(self):
        self.cache.close()


CacheVersusDict.TestCase.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)
test_cache_versus_dict = CacheVersusDict.TestCase
