"""RequestCache: the one facade the server uses (policy -> exact -> semantic -> single-flight -> write-back)."""
from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from strata.cache.request.config import RequestCacheConfig
from strata.cache.request.exact import LRU, ExactCache
from strata.cache.request.guard import MissGuard
from strata.cache.request.keys import NotCacheable, RequestKey, build_key
from strata.cache.request.normalize import normalize_text
from strata.cache.request.pii import has_pii
from strata.cache.request.policy import Decision, Policy
from strata.cache.request.request import AnswerMeta, CacheHit, CacheRequest
from strata.cache.request.single_flight import RELEASED, Flight, SingleFlight
from strata.cache.request.stats import CacheStats
from strata.cache.request.store import Entry, SQLiteStore, Store
from strata.cache.request.store_faults import StoreFaults
from strata.cache.request.store_quota import EntryTooLarge
from strata.cache.request.templating import fill_answer, has_placeholder, template_answer, template_request
from strata.cache.request.tinylfu import TinyLFU
from strata.cache.request.write_back import WriteBack

if TYPE_CHECKING:
    from strata.cache.request.redis_store import RedisStore
    from strata.cache.request.semantic import SemanticCache, SemanticMatch

log = logging.getLogger(__name__)
VECTOR_CHECKS = 8       # stored vectors embedded again at start to tell whether this embedder made them
SAME_VECTOR = 0.99      # cosine of a stored vector to its text's fresh one, at least (the same model: > 0.9999)

__all__ = ["AnswerMeta", "CacheHit", "CacheRequest", "Lookup", "RequestCache", "RequestCacheConfig"]


@dataclass(slots=True, eq=False)
class Lookup:
    """The outcome of one lookup. On a miss (or a no-cache bypass) the caller computes, then calls exactly one of
    complete(text) or fail(exc), and release() when it gives up without either (always safe to call: it releases
    single-flight followers only when neither came); on a hit or a plain bypass all three are harmless no-ops.
    """

    layer: str                        # "exact" | "semantic" | "semantic-similar" | "shared" | "miss" | "bypass" | "negative"
    reason: str                       # TTL class, bypass reason, "single-flight", "penetration-guard", ...
    hit: CacheHit | None = None
    error: Exception | None = None    # layer "negative": the same request failed moments ago
    key: RequestKey | None = field(default=None, repr=False)
    decision: Decision | None = field(default=None, repr=False)
    write: bool = False               # complete() queues a write-back
    cache: RequestCache | None = field(default=None, repr=False)
    flight: Flight | None = field(default=None, repr=False)
    leased: bool = False              # this miss holds the question's cross-replica lease until it is answered
    done: bool = False
    drafts: tuple[str, ...] = ()      # a miss asked for draft_answers: the closest unserved candidates' answers
    generation: int = 0               # the cache's invalidation count when the lookup began: a later one voids the write

    def complete(self, text: str, *, tags: tuple[str, ...] = (), meta: AnswerMeta | None = None) -> None:
        """Hand the computed answer (and its finish reason and token count, replayed with every hit) to waiting
        followers and to the background write (never blocks)."""
        if not isinstance(text, str):
            raise ValueError(f"complete() needs the answer text (str), got {type(text).__name__}")
        if not isinstance(tags, (list, tuple)) or not all(isinstance(t, str) for t in tags):
            raise ValueError("tags must be a list or tuple of str")
        if meta is not None and not isinstance(meta, AnswerMeta):
            raise ValueError(f"meta must be an AnswerMeta or None, got {type(meta).__name__}")
        self._finish()
        if self.cache is not None:
            self.cache._complete(self, text, tuple(tags), meta)

    def fail(self, exc: BaseException) -> None:
        """Release followers with the error (a cancellation lets them compute themselves); remember the failure briefly."""
        if not isinstance(exc, BaseException):
            raise ValueError("fail() needs the exception that stopped the computation")
        self._finish()
        if self.cache is not None:
            self.cache._fail(self, exc)

    def release(self) -> None:
        """Give up without an answer (a client gone before computing, an error before the engine): followers
        stop waiting and compute themselves. A no-op after complete() or fail()."""
        if self.done:
            return
        self.done = True
        if self.flight is not None and self.cache is not None:
            self.cache.flights.finish(self.flight, RELEASED)
        if self.leased and self.cache is not None:
            self.cache._unlease(self.key.exact)

    def _finish(self) -> None:
        if self.done:
            raise RuntimeError("complete()/fail()/release() was already called for this lookup")
        self.done = True


@dataclass(slots=True)
class _Write:
    key: RequestKey
    decision: Decision
    answer: str
    tags: tuple[str, ...]
    generation: int
    meta: AnswerMeta | None = None
    flight: Flight | None = None            # kept joinable until this write lands
    leased: bool = False                    # the cross-replica lease is given back once this write is done
    failed: bool = False                    # the store refused it (a fault, not a policy skip)


class WarmupIncomplete(RuntimeError):
    """The store failed while a warm-up wrote: `written` of `records` landed."""

    def __init__(self, written: int, records: int, fault: str):
        super().__init__(f"{written} of {records} records written; the store failed ({fault})")
        self.written, self.records = written, records


class RequestCache:
    """Exact + semantic response cache in front of any backend; it knows nothing of the engine.

    semantic: a thread-safe SemanticCache (docs/request-cache-interfaces.md) or None for an exact-only cache;
    add() of a known id replaces it.
    store: SQLiteStore (the default) or a shared one (RedisStore, config.redis): then the in-process layer is
    W-TinyLFU, misses take a cross-replica lease, and the other replicas' writes reach this one's layers.
    clock and rng are injectable so TTL and jitter are testable without sleeping.
    """

    def __init__(self, config: RequestCacheConfig | None = None, *, semantic: SemanticCache | None = None,
                 store: Store | None = None, policy: Policy | None = None,
                 clock: Callable[[], float] = time.time, rng: random.Random | None = None):
        self.config = config = config or RequestCacheConfig()
        self.clock = clock
        self.rng = rng or random.Random()
        self.policy = policy or Policy.load(config.policy_rules, temperature_rule=config.temperature_rule,
                                            default_temperature=config.default_temperature)
        self.store = store if store is not None else self.open_store(config)
        self.shared: RedisStore | None = self.store if hasattr(self.store, "follow") else None
        memory = (LRU if self.shared is None else TinyLFU)(config.memory_max_entries, config.memory_max_bytes, clock)
        self.exact = ExactCache(self.store, memory, clock)
        self.semantic = semantic
        self.flights = SingleFlight()
        self.guard = MissGuard(config.miss_window_s, config.miss_limit, config.negative_ttl_s, clock)
        self._stats = CacheStats(config.review_size)
        self.faults = StoreFaults(self._stats, clock)   # a store that fails makes misses, never failed requests
        self.store.on_damaged = self._damaged
        self.touched: dict[str, Entry] = {}       # hit counts not yet persisted
        self.touch_lock = threading.Lock()        # the event loop counts hits, the writer thread persists them
        self.generation = 0                       # bumped by invalidate(): writes queued before it are dropped
        self.write_lock = threading.Lock()
        self.closed = False
        self.last_purge = clock()
        if self.shared is None:
            self._load()
        self.writer = WriteBack(self._write, config.write_queue_size, idle=self._maintain)
        if self.shared is not None:
            self.shared.follow(self)        # the first sync (index from SCAN) runs here when Redis answers

    @staticmethod
    def open_store(config: RequestCacheConfig) -> Store:
        """The store a config names: SQLite (config.db; None = in memory) or Redis (config.redis)."""
        if config.redis is None:
            return SQLiteStore(config.db, reset=config.db_reset, max_bytes=config.max_bytes,
                               tenant_max_share=config.tenant_max_share)
        from strata.cache.request.redis_store import RedisStore

        return RedisStore(config.redis, max_bytes=config.max_bytes, tenant_max_share=config.tenant_max_share,
                          timeout_s=config.redis_timeout_s, queue_size=config.redis_queue_size,
                          stream_len=config.redis_stream_len)

    # ---- lookup -------------------------------------------------------------------------------------------

    async def lookup(self, req: CacheRequest) -> Lookup:
        """Policy, exact layer, semantic layer, then single-flight; see Lookup for what the caller does next."""
        generation = self.generation        # an invalidation while this request computes voids its write
        found = await self._lookup(req)
        found.generation = generation
        return found

    async def _lookup(self, req: CacheRequest) -> Lookup:
        if not isinstance(req, CacheRequest):
            raise ValueError(f"lookup() needs a CacheRequest, got {type(req).__name__}")
        try:
            key = build_key(req, self.config.casefold)
        except NotCacheable as exc:
            self._stats.count(f"bypass.{exc}")
            return Lookup("bypass", str(exc))
        decision = self.policy.decide(req, key)
        if decision.bypass:
            self._stats.count(f"bypass.{decision.reason}")
            return Lookup("bypass", decision.reason, key=key, decision=decision, write=decision.write,
                          cache=self if decision.write else None)
        while True:
            if decision.lookup_exact:
                hit = await self._exact_hit(req, key, decision)
                if hit is not None:
                    return hit
            error = self.guard.failure(key.flight)
            if error is not None:
                self._stats.count("negative.hit")
                return Lookup("negative", "recent-failure", error=error, key=key, decision=decision)
            flight, leader = self.flights.join(key, req.origin)
            if flight is None:              # asked twice in one request: computed twice, written once (the first)
                self._stats.count("bypass.repeat-in-request")
                return Lookup("bypass", "repeat-in-request", key=key, decision=decision)
            if not leader:
                outcome = await self._follow(flight, req, key, decision, None)
                if outcome is not None:
                    return outcome
                continue
            return await self._lead(req, key, decision, flight)

    async def _exact_hit(self, req: CacheRequest, key: RequestKey, decision: Decision) -> Lookup | None:
        """Memory on the event loop; the store (SQLite, which the writer thread may hold) in a worker thread."""
        entry = self.exact.get_memory(key.exact)
        if entry is None:
            entry = await asyncio.to_thread(self.faults.call, "lookup", self.exact.get_stored, key.exact)
        text = self._serve(entry, req, key) if entry is not None else None
        if text is None:
            self._stats.count("exact.miss")
            return None
        now = self._touch(entry)
        age = max(0.0, now - entry.created_at)
        self._stats.observe_hit("exact", 1.0, age)
        return Lookup("exact", decision.reason, CacheHit("exact", text, 1.0, entry.entry_id, age, meta=entry.meta),
                      key=key, decision=decision)

    async def _lead(self, req: CacheRequest, key: RequestKey, decision: Decision, flight: Flight) -> Lookup:
        guarded = self.guard.marked(req.client_id, key)
        if decision.lookup_semantic and self.semantic is not None and not guarded:
            try:
                found = await self._semantic_hit(req, key, decision, flight)
            except asyncio.CancelledError:
                self.flights.finish(flight, RELEASED)
                raise
            except Exception:               # a broken semantic layer degrades to exact-only, never fails the request
                log.exception("semantic lookup failed")
                self._stats.count("semantic.error")
                found = None
            if found is not None:
                return found
        leased = False
        if self.shared is not None and not guarded:
            try:
                leased = await asyncio.to_thread(self.shared.lease, key.exact, self.config.lease_s)
                found = None
                if leased:
                    self._stats.count("lease.taken")
                else:
                    found, leased = await self._wait_for_leaseholder(req, key, decision)
            except BaseException:           # cancelled, or failed: identical requests must not wait on this flight
                self.flights.finish(flight, RELEASED)
                raise
            if found is not None:
                flight.layer, flight.meta = found.hit.layer, found.hit.meta
                self.flights.finish(flight, found.hit.text)
                return found
        self.guard.note_miss(req.client_id, key)
        if guarded:
            self._stats.count("guard.marked")
        drafts = ()
        if req.draft_answers and flight.embedding is not None and not guarded:
            try:
                drafts = await asyncio.to_thread(self._draft_answers, req, key, flight.embedding)
            except asyncio.CancelledError:  # the client left: identical requests waiting on this flight compute
                self.flights.finish(flight, RELEASED)
                if leased:
                    self._unlease(key.exact)
                raise
            except Exception:               # drafts only speed the engine up: a failure costs them, not the request
                log.exception("reading draft answers failed")
                self._stats.count("semantic.error")
        return Lookup("miss", "penetration-guard" if guarded else decision.reason, key=key, decision=decision,
                      write=not guarded, cache=self, flight=flight, leased=leased, drafts=drafts)

    def _draft_answers(self, req: CacheRequest, key: RequestKey, embedding: np.ndarray) -> tuple[str, ...]:
        """The answers of the closest candidates the semantic layer did not serve, as this request would have been
        served them (same tenant, partition, unexpired): an engine may verify them as drafts, never serve them."""
        texts = []
        for entry_id, _, _ in self.semantic.candidates(key.text, key.partition, embedding)[:req.draft_answers]:
            entry = self.faults.call("lookup", self.exact.get, entry_id)
            text = self._serve(entry, req, key) if entry is not None else None
            if text:
                texts.append(text)
        return tuple(texts)

    async def _wait_for_leaseholder(self, req: CacheRequest, key: RequestKey,
                                    decision: Decision) -> tuple[Lookup | None, bool]:
        """Single-flight across replicas: another replica holds the question's lease. Wait for its answer in the store
        (a hit, False); take the lease over when it is given back or expires without one (None, True: compute it);
        or give up after lease_wait_s (None, False: compute anyway)."""
        deadline = time.monotonic() + self.config.lease_wait_s
        while time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            found = await self._stored_answer(req, key, decision)
            if found is not None:
                return found, False
            if await asyncio.to_thread(self.shared.lease, key.exact, self.config.lease_s):
                found = await self._stored_answer(req, key, decision)    # it may have landed just before the lease went
                if found is not None:
                    self._unlease(key.exact)
                    return found, False
                self._stats.count("lease.taken_over")
                return None, True
        self._stats.count("lease.timeout")
        return None, False

    async def _stored_answer(self, req: CacheRequest, key: RequestKey, decision: Decision) -> Lookup | None:
        """The leaseholder's answer once it is in the shared store, served as an exact hit."""
        entry = await asyncio.to_thread(self.faults.call, "lookup", self.exact.get_stored, key.exact)
        text = self._serve(entry, req, key) if entry is not None else None
        if text is None:
            return None
        self._stats.count("lease.answered")
        age = max(0.0, self._touch(entry) - entry.created_at)
        self._stats.observe_hit("exact", 1.0, age)
        return Lookup("exact", "lease", CacheHit("exact", text, 1.0, entry.entry_id, age, meta=entry.meta),
                      key=key, decision=decision)

    async def _semantic_hit(self, req: CacheRequest, key: RequestKey, decision: Decision, flight: Flight) -> Lookup | None:
        if not self.semantic.serves(key.text):
            self._stats.count("semantic.off")
            if req.draft_answers:       # drafts are verified by the model: they need neighbours, not a certified bound
                flight.embedding = await asyncio.to_thread(self.semantic.embed, key.text)
            return None
        flight.embedding, match, entry = await asyncio.to_thread(self._embed_and_search, key)
        if match is not None:
            text = self._serve(entry, req, key) if entry is not None else None
            if text is None:
                self._stats.count("semantic.rejected")
            else:
                now = self._touch(entry)
                found = self._semantic_lookup(req, key, decision, match, text, entry.entry_id,
                                              max(0.0, now - entry.created_at), decision.reason, entry.meta)
                flight.layer, flight.similarity, flight.meta = found.layer, match.similarity, entry.meta
                self.flights.finish(flight, text)
                return found
        self._stats.count("semantic.miss")
        found = await self._follow_neighbour(req, key, decision, flight)
        if found is not None:
            flight.layer, flight.similarity, flight.meta = found.hit.layer, found.hit.similarity, found.hit.meta
            self.flights.finish(flight, found.hit.text)
        return found

    async def _follow_neighbour(self, req: CacheRequest, key: RequestKey, decision: Decision,
                                flight: Flight) -> Lookup | None:
        """Wait for a pending request whose question the semantic layer would answer this one from, were it stored:
        the same decision (SemanticCache.decide) as for stored entries, so nothing it would refuse is shared."""
        pending = self.flights.pending(flight, self.semantic.min_similarity(key.text))[:self.semantic.top_k]
        if not pending:
            return None
        by_id = {other.key.flight: other for other, _ in pending}
        match = await asyncio.to_thread(self.semantic.decide, key.text,
                                        [(other.key.flight, sim, other.key.text) for other, sim in pending])
        if match is None or not self.flights.follow(flight, by_id[match.entry_id]):
            return None
        try:
            return await self._follow(by_id[match.entry_id], req, key, decision, match)
        finally:
            flight.following = False

    def _semantic_lookup(self, req: CacheRequest, key: RequestKey, decision: Decision, match: SemanticMatch,
                         text: str, entry_id: str, age: float, reason: str, meta: AnswerMeta | None) -> Lookup:
        """A served semantic answer, labelled by its tier, counted, and kept for review when near the threshold."""
        layer = "semantic" if match.tier == "serve" else "semantic-similar"
        self._stats.observe_hit(layer, match.similarity, age)
        if layer == "semantic-similar" or match.similarity < self.config.review_below:
            self._stats.near_threshold.append({
                "time": self.clock(), "tenant": req.tenant, "query": key.text, "cached": match.cached_text,
                "similarity": match.similarity, "tier": match.tier, "entry_id": entry_id})
        return Lookup(layer, reason, CacheHit(layer, text, match.similarity, entry_id, age, meta=meta), key=key,
                      decision=decision)

    def _embed_and_search(self, key: RequestKey) -> tuple[np.ndarray, SemanticMatch | None, Entry | None]:
        """Embed, search and read the matched entry in one worker-thread hop: under load each hop waits for the GIL
        and a core again, and the entry may have to come from the store."""
        embedding = self.semantic.embed(key.text)
        match = self.semantic.lookup(key.text, key.partition, embedding)
        entry = self.faults.call("lookup", self.exact.get, match.entry_id) if match is not None else None
        return embedding, match, entry

    async def _follow(self, flight: Flight, req: CacheRequest, key: RequestKey, decision: Decision,
                      match: SemanticMatch | None) -> Lookup | None:
        """Await a leader. match None: same literal request, its answer is ours. Otherwise a semantic neighbour the
        semantic layer accepted: only an answer it computed serves (one it got from the cache answered its own
        question, which was never compared with ours), and only if not personal or it re-templates onto ours."""
        try:
            outcome = await asyncio.wait_for(asyncio.shield(flight.future), self.config.follow_timeout_s)
        except TimeoutError:                # the leader hangs: drop its flight so the next request leads afresh
            self._stats.count("single_flight.timeout")
            self.flights.drop(flight)       # the other followers wait out their own time (releasing them all let
            return None                     # every one compute at once while a slow leader still ran)
        except Exception as exc:
            if match is not None:
                return None
            self._stats.count("single_flight.error")
            return Lookup("negative", "leader-failed", error=exc, key=key, decision=decision)
        if outcome is RELEASED:
            return None
        if match is None and not _may_share(flight.layer, decision):
            return None                     # the leader's answer came from a layer this request does not read
        if match is None:                   # same literal request: the answer the leader got, shared as it came
            self._stats.count("single_flight.follower")
            self._stats.observe_hit("shared", flight.similarity, 0.0)
            hit = CacheHit("shared", outcome, flight.similarity, key.exact, 0.0, source=flight.layer, meta=flight.meta)
            return Lookup("shared", "single-flight", hit, key=key, decision=decision)
        text = self._retemplate(outcome, flight.key, key) if flight.layer == "miss" else None
        if text is None:
            return None
        self._stats.count("single_flight.neighbour")
        return self._semantic_lookup(req, key, decision, match, text, flight.key.exact, 0.0, "single-flight",
                                     flight.meta)

    def _serve(self, entry: Entry, req: CacheRequest, key: RequestKey) -> str | None:
        """The entry's answer filled for this request, or None when it must not serve it (tenant, partition, expiry)."""
        if entry.tenant != req.tenant or entry.partition != key.partition or entry.expires_at <= self.clock():
            return None
        return fill_answer(entry.answer, key.values) if has_placeholder(entry.answer) else entry.answer

    @staticmethod
    def _retemplate(answer: str, source: RequestKey, target: RequestKey) -> str | None:
        if not source.personal:
            return None if target.personal or has_pii(answer) else answer
        templated = template_answer(answer, source.values)
        return None if templated is None else fill_answer(templated, target.values)

    def _touch(self, entry: Entry) -> float:
        now = self.clock()
        with self.touch_lock:
            entry.hits += 1
            entry.last_hit = now
            self.touched[entry.entry_id] = entry
        return now

    async def get_or_compute(self, req: CacheRequest, compute: Callable[[], Awaitable[str]]) -> tuple[str, Lookup]:
        """Look up, compute on a miss (always releasing followers), and return (answer, lookup)."""
        lookup = await self.lookup(req)
        if lookup.hit is not None:
            return lookup.hit.text, lookup
        if lookup.error is not None:
            raise lookup.error
        try:
            text = await compute()
        except BaseException as exc:
            lookup.fail(exc)
            raise
        lookup.complete(text)
        return text, lookup

    # ---- write path ---------------------------------------------------------------------------------------

    def _complete(self, lookup: Lookup, text: str, tags: tuple[str, ...], meta: AnswerMeta | None) -> None:
        flight = lookup.flight
        submitted = False
        if lookup.write and not self.closed:
            submitted = self.writer.submit(_Write(lookup.key, lookup.decision, text, tags, lookup.generation, meta, flight,
                                                  lookup.leased))
            if not submitted:
                self._stats.count("write.dropped")
        if lookup.leased and not submitted:
            self._unlease(lookup.key.exact)
        if flight is not None:
            flight.meta = meta
            self.flights.finish(flight, text, until_stored=submitted)
        self.guard.forget_failure(lookup.key.flight)

    def _fail(self, lookup: Lookup, exc: BaseException) -> None:
        if lookup.leased:
            self._unlease(lookup.key.exact)
        if lookup.flight is not None:
            self.flights.finish(lookup.flight, exc if isinstance(exc, Exception) else RELEASED)
        if isinstance(exc, Exception) and lookup.key is not None:
            self.guard.note_failure(lookup.key.flight, exc)

    def _write(self, job: _Write) -> bool:
        """Store one answer, then let its flight go (repeats meanwhile were served from it)."""
        try:
            return self._store(job)
        finally:
            if job.flight is not None:
                self.flights.drop(job.flight)
            if job.leased:
                self._unlease(job.key.exact)

    def _unlease(self, entry_id: str) -> None:
        """Give the cross-replica lease back off the event loop (a slow Redis must not stall it; a lease that is not
        given back expires by itself)."""
        try:
            asyncio.get_running_loop().run_in_executor(None, self.shared.unlease, entry_id)
        except RuntimeError:                # no running loop: the writer thread or a synchronous caller
            self.shared.unlease(entry_id)

    def _store(self, job: _Write) -> bool:
        """PII filter, templating, TTL with jitter, embedding, store; runs on the writer thread (warm-up: inline)."""
        skip = self._why_not_write(job)
        answer = None
        if skip is None:
            answer = template_answer(job.answer, job.key.values) if job.key.personal else job.answer
            skip = "untemplatable" if answer is None else None
        key = job.key
        semantic = self.semantic is not None and job.decision.write_semantic
        embedding = self.semantic.embed(key.text) if skip is None and semantic else None
        with self.write_lock:               # an invalidate() never interleaves with a store write
            if skip is None and job.generation != self.generation:
                skip = "invalidated"
            if skip is not None:
                self._stats.count(f"write.skipped_{skip}")
                return False
            now = self.clock()
            ttl = job.decision.ttl_s * self.rng.uniform(1 - self.config.ttl_jitter, 1 + self.config.ttl_jitter)
            entry = Entry(key.exact, key.partition, key.tenant, key.model, key.text, answer, now, now + ttl,
                          job.decision.ttl_class, job.tags, semantic=semantic, embedding=embedding, meta=job.meta)
            try:
                evicted = self.store.put(entry)
            except EntryTooLarge:
                self._stats.count("write.skipped_too_large")
                return False
            except Exception as exc:
                self.faults.report("write", exc)
                self._stats.count("write.failed")
                job.failed = True
                return False
            self._forget([entry_id for entry_id, _ in evicted])
            for _, reason in evicted:
                self._stats.count(f"store.evicted_{reason}")
            self.exact.remember(entry)
            if semantic:
                self.semantic.add(entry.entry_id, key.text, key.partition, embedding)
        self._stats.count("write.written")
        return True

    def _why_not_write(self, job: _Write) -> str | None:
        if not job.answer.strip():
            return "empty"
        if not job.key.personal and (has_placeholder(job.answer) or has_pii(job.answer)):
            return "pii"
        return None

    def _persist_hits(self) -> None:
        """Store pending hit counts; a store fault drops them (statistics, not answers)."""
        with self.touch_lock:
            touched, self.touched = self.touched, {}
            counts = [(entry.entry_id, entry.hits, entry.last_hit) for entry in touched.values()]

        def touch_all() -> None:
            for entry_id, hits, last_hit in counts:
                self.store.touch(entry_id, hits, last_hit)

        self.faults.call("touch", touch_all)

    # ---- maintenance --------------------------------------------------------------------------------------

    def _maintain(self) -> None:
        """Writer idle work: persist hit counts; once a minute, delete expired entries from every layer."""
        self._persist_hits()
        now = self.clock()
        if now - self.last_purge >= 60.0:
            self.last_purge = now
            with self.write_lock:
                self.faults.call("purge", self._purge, now)

    def _purge(self, now: float) -> None:
        self._remove(self.store.expired(now))

    def _load(self) -> None:
        """Drop expired entries, then rebuild the semantic index from stored embeddings (re-embed on a mismatch).
        A store that fails meanwhile leaves the index partial and the cache degraded, not the server down."""
        self.faults.call("purge", self._purge, self.clock())
        if self.semantic is not None:
            self.faults.call("load", self._index_stored)

    def _index_stored(self) -> set[str]:
        """Index every stored semantic entry; returns their ids. Stored vectors are used only when a few of them are
        what this embedder makes of their texts: another embedder of the same width (minilm and e5-small are both
        384 wide) put vectors of another space there, and every semantic hit on them was lost or wrong."""
        entries = [entry for entry in self.store.entries() if entry.semantic]
        ours = self._vectors_are_ours([e for e in entries if e.embedding is not None][:VECTOR_CHECKS])
        if not ours:
            log.warning("the stored embeddings were made by another embedder: embedding %d entries again",
                        len(entries))
        for entry in entries:
            self._index(entry if ours else replace(entry, embedding=None))
        return {entry.entry_id for entry in entries}

    def _vectors_are_ours(self, sample: list[Entry]) -> bool:
        for entry in sample:
            fresh, stored = self.semantic.embed(entry.text), np.asarray(entry.embedding, np.float32)
            if fresh.shape != stored.shape or float(fresh @ stored) < SAME_VECTOR * float(np.linalg.norm(stored)):
                return False
        return True

    def _index(self, entry: Entry) -> None:
        try:
            self.semantic.add(entry.entry_id, entry.text, entry.partition, entry.embedding)
        except ValueError:      # stored embedding from another embedder: embed again
            self.semantic.add(entry.entry_id, entry.text, entry.partition, None)

    # ---- a shared store's events (StoreListener; the stream follower's thread) ----------------------------

    def stored_elsewhere(self, entry_id: str) -> None:
        """Another replica wrote an entry: drop what this one remembers of the id, index the new one (under the write
        lock: an invalidation here between the read and the add left the deleted id in the index)."""
        self.exact.forget([entry_id])
        if self.semantic is not None:
            with self.write_lock:
                entry = self.store.get(entry_id)
                if entry is not None and entry.semantic:
                    self._index(entry)

    def deleted_elsewhere(self, entry_ids: list[str]) -> None:
        """Another replica invalidated, evicted or purged entries."""
        self._forget(entry_ids)

    def resync(self) -> None:
        """Events may have been missed (start, outage, gap): forget the in-process layer, rebuild the index from
        the store (SCAN), under the write lock so that no write lands between the scan and the cleanup. The store
        answered the flush and the scan, so the outage's faults no longer make health() "degraded"."""
        with self.write_lock:
            self.exact.clear()
            if self.semantic is not None:
                seen = self._index_stored()
                for entry_id in set(self.semantic.ids()) - seen:
                    self.semantic.remove(entry_id)
        self.faults.resolved()

    def _remove(self, entry_ids) -> int:
        """Forget, delete, forget again: the second drops a copy that a lookup read from the store before the
        delete and promoted to memory meanwhile (and voids one still being read)."""
        entry_ids = list(entry_ids)
        self._forget(entry_ids)
        deleted = self.store.delete(entry_ids)
        self.exact.forget(entry_ids)
        return deleted

    def _damaged(self, entry_ids: list[str]) -> None:
        """The store dropped entries whose content failed its checksum: count them, forget them here too."""
        self._stats.count("store.damaged", len(entry_ids))
        self._forget(entry_ids)

    def _forget(self, entry_ids: list[str]) -> None:
        """Drop entries from the memory layer and the semantic index (the store no longer has them)."""
        self.exact.forget(entry_ids)
        if self.semantic is not None:
            for entry_id in entry_ids:
                self.semantic.remove(entry_id)

    def invalidate(self, *, entry_id: str | None = None, tag: str | None = None, partition: str | None = None,
                   model: str | None = None, similar_to: str | None = None, min_similarity: float = 0.9,
                   tenant: str | None = None) -> int:
        """Delete every entry matching all given filters; returns how many were deleted.

        partition matches itself and every partition under it ("tenant|model" = one model version of one tenant).
        similar_to needs the semantic layer. Writes still queued when this runs are dropped.
        """
        if all(v is None for v in (entry_id, tag, partition, model, similar_to, tenant)):
            raise ValueError("invalidate() needs at least one of entry_id, tag, partition, model, similar_to, tenant")
        candidates: set[str] | None = {entry_id} if entry_id is not None else None
        if similar_to is not None:
            if self.semantic is None:
                raise ValueError("invalidate(similar_to=...) needs the semantic layer")
            if not 0.0 < min_similarity <= 1.0:
                raise ValueError(f"min_similarity must be in (0, 1], got {min_similarity}")
            text = template_request(normalize_text(similar_to)).text
            similar = set(self.semantic.similar_ids(text, min_similarity, None))
            candidates = similar if candidates is None else candidates & similar
        # an admin must not be told it worked: a store fault propagates. Under the write lock from the query on, so
        # a write landing meanwhile is either matched here or dropped by the generation
        with self.faults.watch("delete"), self.write_lock:
            if any(v is not None for v in (tag, partition, model, tenant)):
                matching = set(self.store.ids(tag=tag, partition=partition, model=model, tenant=tenant))
                candidates = matching if candidates is None else candidates & matching
            self.generation += 1
            self.flights.drop_answered()
            return self._remove(candidates)

    def warmup(self, records: Iterable[dict], *, tenant: str = "default", model: str | None = None,
               sampling: dict | None = None) -> int:
        """Write FAQ answers from records {"question", "answer", "tenant"?, "model"?, "tags"?, "ttl_class"?}.

        Entries are keyed as a single-turn user question with `sampling` (default {"temperature": 0}); records the
        policy bypasses are skipped. Every record is checked before any is written (ValueError "record N: ...").
        Returns how many were written; WarmupIncomplete when the store failed on some. Embeds and writes: call it off
        the event loop.
        """
        jobs = []
        for n, row in enumerate(records, 1):
            try:
                if not isinstance(row, dict) or not isinstance(row.get("question"), str) \
                        or not isinstance(row.get("answer"), str):
                    raise ValueError("needs string fields 'question' and 'answer'")
                req = CacheRequest(row.get("tenant", tenant), row.get("model", model),
                                   [{"role": "user", "content": row["question"]}],
                                   dict(sampling if sampling is not None else {"temperature": 0.0}))
                key = build_key(req, self.config.casefold)
                decision = self.policy.decide(req, key)
                if "ttl_class" in row:
                    if not isinstance(row["ttl_class"], str):
                        raise ValueError("'ttl_class' must be a string")
                    decision.ttl_class, decision.ttl_s = row["ttl_class"], self.policy.ttl_of(row["ttl_class"])
                tags = row.get("tags", [])
                if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
                    raise ValueError("'tags' must be a list of strings")
            except (ValueError, NotCacheable) as exc:
                raise ValueError(f"record {n}: {exc}") from None
            if decision.bypass:
                self._stats.count(f"warmup.skipped_{decision.reason}")
                continue
            jobs.append(_Write(key, decision, row["answer"], tuple(tags), self.generation))
        written = sum(self._write(job) for job in jobs)
        if any(job.failed for job in jobs):
            raise WarmupIncomplete(written, n, self.faults.last)     # n: a failed job means records were read
        return written

    # ---- observability and lifecycle ----------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters per layer (exact/semantic/bypass/single_flight/write/...), similarity and hit-age histograms, sizes."""
        snap = self._stats.snapshot()
        usage = self.store.usage()
        snap["entries"] = {"memory": len(self.exact), "store": usage["entries"],
                           "semantic": len(self.semantic) if self.semantic is not None else 0}
        snap["write_queue"] = {"pending": self.writer.queue.qsize(), "errors": self.writer.errors}
        snap["store_bytes"] = {"used": usage["bytes"], "max": usage["max_bytes"],
                               "tenant_max": usage["tenant_max_bytes"], "tenants": usage["tenants"]}
        if self.shared is not None:
            snap["redis"] = self.shared.link()
        # what the error bound certified per language (a language with "similar": None is not served semantically)
        snap["semantic"] = getattr(self.semantic, "calibration", {}) if self.semantic is not None else {}
        return snap

    def health(self) -> dict:
        """{"status": "ok" | "degraded", "reason": str} for /health: degraded while store faults are recent (lookups
        miss, writes are lost), while the write queue is full (answers are dropped), or once the writer failed
        otherwise (a bug: it stays until restart). Reads no store: loop-safe."""
        reasons = []
        faults = self.faults.recent()
        if faults:
            reasons.append(f"{faults} store fault(s) in the last {self.faults.recent_s:.0f} s, latest {self.faults.last}")
        if self.writer.queue.full():
            reasons.append(f"write queue full ({self.writer.queue.maxsize} pending): answers are not being stored")
        if self.writer.errors:
            reasons.append(f"{self.writer.errors} background write error(s)")
        shared = self.shared.health() if self.shared is not None else None
        if shared:
            reasons.insert(0, shared)
        return {"status": "degraded" if reasons else "ok", "reason": "; ".join(reasons)}

    def review(self, limit: int = 50) -> list[dict]:
        """The latest near-threshold semantic hits (newest first), for a human to judge."""
        if not isinstance(limit, int) or limit < 0:
            raise ValueError("limit must be an int >= 0")
        return list(reversed(self._stats.near_threshold))[:limit]

    async def drain(self) -> None:
        """Wait until every queued write is stored (tests, shutdown)."""
        await asyncio.to_thread(self.writer.join)
        await asyncio.to_thread(self._persist_hits)

    def close(self) -> None:
        """Finish queued writes, persist hit counts, close the store. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.writer.close()
        self._persist_hits()
        self.faults.call("close", self.store.close)


def _may_share(layer: str, decision: Decision) -> bool:
    """Whether a follower may take the answer its leader got from `layer`: one it computed always; one from the cache
    only if the follower reads that layer itself (an exact-only request never takes a semantic answer, a refresh
    none)."""
    if layer == "miss":
        return True
    return decision.lookup_semantic if layer.startswith("semantic") else decision.lookup_exact
