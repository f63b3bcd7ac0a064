"""Redis/Valkey store shared by many replicas: the Store protocol on Redis (entries with their TTL, keys namespaced by
tenant and model, byte bounds enforced in one script per write), plus what only a shared store has: a stream of
writes and invalidations (redis_sync.py follows it), a cross-replica lease per question, and a degraded mode.

Degraded mode: Redis down or slow never fails a request. Reads miss (the in-process L1 and the local index still
serve), writes wait in a bounded queue (the oldest dropped and counted), the breaker stops calls until the follower's
probe finds Redis back, flushes the queue and resyncs."""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from importlib import resources
from typing import Protocol
from urllib.parse import quote

import numpy as np
import redis
import xxhash
from redis.backoff import NoBackoff
from redis.retry import Retry

from strata.cache.request.redis_breaker import Breaker
from strata.cache.request.request import AnswerMeta
from strata.cache.request.store import Entry, report_damaged, stored_size
from strata.cache.request.store_quota import StoreQuota

log = logging.getLogger(__name__)

LINK_ERRORS = (redis.ConnectionError, redis.TimeoutError)
_SCRIPT = resources.files("strata.cache.request").joinpath("data/redis_store.lua").read_text()
# compare-and-delete: a lease that expired and was taken by another replica is not ours to delete
_RELEASE_LEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


class StoreUnavailable(RuntimeError):
    """Redis is down (the breaker is open): the call was not tried."""


class StoreListener(Protocol):
    """What a shared store tells the cache in front of it (redis_sync.py calls these on its own thread)."""

    def stored_elsewhere(self, entry_id: str) -> None: ...        # another replica wrote this entry
    def deleted_elsewhere(self, entry_ids: list[str]) -> None: ...  # another replica deleted (or evicted) these
    def resync(self) -> None: ...                                  # events may be lost: rebuild from entries()


def namespace(tenant: str, model: str) -> str:
    """The key part of a tenant and a model, quoted so that neither ':' nor glob characters can cross it."""
    return f"{quote(tenant, safe='')}:{quote(model, safe='')}"


def _fields(entry: Entry) -> list:
    """The entry as HSET field/value pairs (the id is in the key)."""
    pairs = {"partition": entry.partition, "tenant": entry.tenant, "model": entry.model, "text": entry.text,
             "answer": entry.answer, "created_at": repr(entry.created_at), "expires_at": repr(entry.expires_at),
             "ttl_class": entry.ttl_class, "tags": json.dumps(list(entry.tags)), "semantic": int(entry.semantic),
             "hits": entry.hits, "last_hit": "" if entry.last_hit is None else repr(entry.last_hit)}
    if entry.embedding is not None:
        pairs["embedding"] = np.asarray(entry.embedding, np.float32).tobytes()
    if entry.meta is not None:
        pairs["meta"] = entry.meta.to_json()
    stored = {name.encode(): value if isinstance(value, bytes) else str(value).encode() for name, value in pairs.items()}
    stored[b"checksum"] = str(_checksum(stored)).encode()
    return [x for pair in stored.items() for x in pair]


_UNCHECKED = (b"hits", b"last_hit", b"checksum")     # the hit counters change on every hit (touch)


def _checksum(fields: dict[bytes, bytes]) -> int:
    """xxh64 of a hash's stored fields but the hit counters, in name order: computed from the bytes as stored, so a
    replica of another version (with fields it does not know) checks it the same."""
    digest = xxhash.xxh64()
    for name in sorted(fields):
        if name not in _UNCHECKED:
            for part in (name, fields[name]):
                digest.update(len(part).to_bytes(8, "little"))
                digest.update(part)
    return digest.intdigest()


class _Damaged(Exception):
    """A hash whose content no longer matches its checksum field."""


def _entry(entry_id: str, fields: dict[bytes, bytes]) -> Entry | None:
    """An entry from its HGETALL reply; None when empty (absent or expired); _Damaged when its content changed under
    its checksum (a hash from before checksums has none and is taken as it is)."""
    if not fields:
        return None
    if b"checksum" in fields and fields[b"checksum"] != str(_checksum(fields)).encode():
        raise _Damaged(entry_id)
    text = {k.decode(): v.decode() for k, v in fields.items() if k != b"embedding"}
    blob = fields.get(b"embedding")
    return Entry(entry_id, text["partition"], text["tenant"], text["model"], text["text"], text["answer"],
                 float(text["created_at"]), float(text["expires_at"]), text["ttl_class"],
                 tuple(json.loads(text["tags"])), text["semantic"] == "1", int(text["hits"]),
                 float(text["last_hit"]) if text["last_hit"] else None,
                 None if blob is None else np.frombuffer(blob, np.float32).copy(),
                 AnswerMeta.from_json(text["meta"]) if "meta" in text else None)


class RedisStore:
    """Store protocol on Redis (see module doc). Thread-safe: redis-py's pool serves the lookup workers, the writer
    thread and the follower. `origin` tells this replica's own stream events from the others'."""

    def __init__(self, url: str, *, max_bytes: int = 2**30, tenant_max_share: float = 1.0, timeout_s: float = 0.25,
                 queue_size: int = 10_000, stream_len: int = 100_000, prefix: str = "strata"):
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--cache-redis needs a redis://, rediss:// or unix:// URL, got {url!r}")
        self.url, self.prefix, self.stream_len, self.timeout_s = url, prefix, stream_len, timeout_s
        self.quota = StoreQuota(max_bytes, tenant_max_share)
        self.origin = f"{int(time.time() * 1000):x}-{id(self):x}"
        no_retry = Retry(NoBackoff(), 0)        # the breaker decides about retries, not the client
        try:
            self.redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                              retry=no_retry, health_check_interval=0)
        except ValueError as exc:
            raise ValueError(f"--cache-redis {url!r}: {exc}") from None
        self.script = self.redis.register_script(_SCRIPT)
        self.release_script = self.redis.register_script(_RELEASE_LEASE)
        self.breaker = Breaker()
        self.queue: deque[tuple[str, object]] = deque()     # ("put", Entry) | ("delete", ids) while down
        self.queue_size = queue_size
        self.dropped = 0
        self.malformed = 0      # hashes an index rebuild could not read (written by hand, or by another version)
        self.queue_lock = threading.Lock()
        self.follower = None
        self.on_damaged: Callable[[list[str]], None] | None = None     # see store.Store

    # ---- the Store protocol -------------------------------------------------------------------------------

    def put(self, entry: Entry) -> list[tuple[str, str]]:
        """Write one entry (evicting what the bounds require, in the same script); while Redis is down, queue it (a
        write that fails while the link is still up is dropped, counted)."""
        size = stored_size(entry)
        self.quota.check(size)
        if not self.breaker.up:
            self._enqueue("put", entry)
            return []
        try:
            return self._put(entry, size)
        except LINK_ERRORS as exc:
            self.breaker.failure(exc)
            if self.breaker.up:     # it may have landed, and the link works: a copy replayed after some later outage
                with self.queue_lock:   # would undo the invalidations and newer answers that succeed meanwhile
                    self.dropped += 1
            else:
                self._enqueue("put", entry)
            return []

    def _put(self, entry: Entry, size: int) -> list[tuple[str, str]]:
        ptr = json.dumps([namespace(entry.tenant, entry.model), entry.tenant, size, list(entry.tags)])
        victims, reasons, totals = self._call("put", entry.entry_id, ptr, int(entry.expires_at * 1000),
                                              int(time.time() * 1000), self.quota.max_bytes,
                                              self.quota.tenant_max_bytes, *_fields(entry))
        self._totals(totals)
        return [(v.decode(), r.decode()) for v, r in zip(victims, reasons, strict=True)]

    def get(self, entry_id: str) -> Entry | None:
        """The entry, or None (absent, expired, or Redis down: a miss)."""
        if not self.breaker.up:
            return None
        flat = self._call("get", entry_id)
        try:
            return _entry(entry_id, dict(zip(flat[::2], flat[1::2], strict=True)))
        except _Damaged:
            self._drop_damaged([entry_id])
            return None

    def _drop_damaged(self, entry_ids: list[str]) -> None:
        """Delete entries whose content failed its checksum (the stream tells the other replicas), log, tell ours (also
        when the delete fails: never served either way, a later read tries the delete again)."""
        try:
            self.delete(entry_ids)
        finally:
            report_damaged(entry_ids, self.on_damaged)

    def delete(self, entry_ids: list[str]) -> int:
        """Delete entries by id (announced on the stream); StoreUnavailable while Redis is down."""
        if not entry_ids:
            return 0
        self._require_up()
        gone, _, totals = self._call("delete", *entry_ids)
        self._totals(totals)
        return len(gone)

    def ids(self, *, tag: str | None = None, partition: str | None = None, model: str | None = None,
            tenant: str | None = None) -> list[str]:
        """Ids of live entries matching every filter (partition covers the partitions under it), as SQLiteStore."""
        self._require_up()
        try:
            if tag is not None:
                found = [i.decode() for i in self.redis.smembers(f"{self.prefix}:tag:{tag}")]
                pointers = self.redis.hmget(f"{self.prefix}:ids", found) if found else []
                rows = [(i, json.loads(p)[0]) for i, p in zip(found, pointers, strict=True) if p is not None]
            else:
                rows = list(self._scan(tenant, model))
            keep = []
            for (entry_id, _), (row_tenant, row_model, row_partition) in zip(rows, self._heads(rows), strict=True):
                if row_partition is None:
                    continue        # expired meanwhile
                if (tenant is None or row_tenant == tenant) and (model is None or row_model == model) and (
                        partition is None or row_partition == partition or row_partition.startswith(partition + "|")):
                    keep.append(entry_id)
            self.breaker.success()
            return keep
        except LINK_ERRORS as exc:
            self.breaker.failure(exc)
            raise

    def _scan(self, tenant: str | None = None, model: str | None = None) -> Iterator[tuple[str, str]]:
        """(id, namespace) of every live entry key, narrowed by tenant and model through the key pattern."""
        glob = lambda part: "*" if part is None else quote(part, safe="")      # noqa: E731 (quote leaves no glob char)
        pattern = f"{self.prefix}:{glob(tenant)}:{glob(model)}:e:*"
        cut = len(self.prefix) + 1
        for key in self.redis.scan_iter(match=pattern, count=1000):
            ns, _, entry_id = key.decode()[cut:].rpartition(":e:")
            yield entry_id, ns

    def _heads(self, rows: list[tuple[str, str]]) -> list[tuple[str | None, ...]]:
        """(tenant, model, partition) of each (id, namespace), one pipelined round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for entry_id, ns in rows:
            pipe.hmget(f"{self.prefix}:{ns}:e:{entry_id}", "tenant", "model", "partition")
        return [tuple(None if v is None else v.decode() for v in head) for head in pipe.execute()] if rows else []

    def touch(self, entry_id: str, hits: int, last_hit: float) -> None:
        """Persist hit count and last use (the LRU rank); skipped while Redis is down (statistics, not answers)."""
        if self.breaker.up:
            self._call("touch", entry_id, hits, repr(last_hit), int(last_hit * 1000))

    def expired(self, now: float) -> list[str]:
        """Ids whose TTL passed (Redis dropped their entry; the caller deletes the rest)."""
        self._require_up()
        try:
            found = self.redis.zrangebyscore(f"{self.prefix}:exp", "-inf", int(now * 1000))
        except LINK_ERRORS as exc:
            self.breaker.failure(exc)
            raise
        return [i.decode() for i in found]

    def entries(self) -> Iterator[Entry]:
        """Every live entry, by SCAN and pipelined HGETALL in pages (index rebuilds on start and after a gap)."""
        self._require_up()
        try:
            rows = list(self._scan())
            for start in range(0, len(rows), 500):
                page = rows[start:start + 500]
                pipe = self.redis.pipeline(transaction=False)
                for entry_id, ns in page:
                    pipe.hgetall(f"{self.prefix}:{ns}:e:{entry_id}")
                damaged = []
                for (entry_id, ns), fields in zip(page, pipe.execute(), strict=True):
                    try:
                        entry = _entry(entry_id, fields)
                    except _Damaged:
                        damaged.append(entry_id)
                        continue
                    except (KeyError, ValueError, TypeError) as exc:  # one bad hash must not stop a rebuild
                        self.malformed += 1
                        log.warning("request-cache redis: skipped malformed entry %s:%s:e:%s (%s: %s); a lookup "
                                    "of it is a miss", self.prefix, ns, entry_id, type(exc).__name__, exc)
                        continue
                    if entry is not None:
                        yield entry
                if damaged:
                    self._drop_damaged(damaged)
        except LINK_ERRORS as exc:
            self.breaker.failure(exc)
            raise

    def usage(self) -> dict:
        """Totals as the latest script or follower read them: no I/O (safe on the event loop)."""
        return self.quota.usage()

    def __len__(self) -> int:
        return self.quota.usage()["entries"]

    def close(self) -> None:
        """Stop following the stream; queued writes that could not be flushed are lost (and were counted)."""
        if self.follower is not None:
            self.follower.stop()
        self.redis.close()

    # ---- what a shared store adds -------------------------------------------------------------------------

    def follow(self, listener: StoreListener) -> None:
        """Start the stream follower (redis_sync.py); the first sync runs now when Redis is up, so a replica has its
        index before it serves."""
        from strata.cache.request.redis_sync import StreamFollower

        self.follower = StreamFollower(self, listener)
        self.follower.start()

    def lease(self, entry_id: str, ttl_s: float) -> bool:
        """Take the cross-replica lease on a question (SET NX PX); True: compute it. False: another replica holds it.
        Redis down: True (every replica computes for itself)."""
        if not self.breaker.up:
            return True
        try:
            taken = self.redis.set(f"{self.prefix}:lease:{entry_id}", self.origin, nx=True, px=int(ttl_s * 1000))
        except LINK_ERRORS as exc:
            self.breaker.failure(exc)
            return True
        return bool(taken)

    def unlease(self, entry_id: str) -> None:
        """Give the question's lease back (only if this replica still holds it), so that other replicas stop waiting
        at once when the answer is stored, skipped or never came, instead of at the lease's expiry."""
        if not self.breaker.up:
            return
        try:
            self.release_script(keys=[f"{self.prefix}:lease:{entry_id}"], args=[self.origin])
        except LINK_ERRORS as exc:
            self.breaker.failure(exc)

    def flush(self) -> bool:
        """Replay the queued writes in order (the follower, on recovery); False when Redis failed again meanwhile
        (what is left stays queued)."""
        while True:
            with self.queue_lock:
                if not self.queue:
                    return True
                op, what = self.queue[0]
            try:
                if op == "put":
                    self._put(what, stored_size(what))
                else:
                    self._call("delete", *what)
            except LINK_ERRORS as exc:
                self.breaker.failure(exc)
                return False
            with self.queue_lock:
                if self.queue and self.queue[0][1] is what:
                    self.queue.popleft()

    def link(self) -> dict:
        """The link's state as plain data for stats() and /metrics."""
        follower = self.follower
        with self.queue_lock:
            queued = len(self.queue)
        return {"up": self.breaker.up, "errors": self.breaker.errors, "queue": queued, "dropped": self.dropped,
                "malformed": self.malformed, "stream_lag_s": follower.lag_s if follower is not None else 0.0,
                "resyncs": follower.resyncs if follower is not None else 0}

    def health(self) -> str | None:
        """Why the shared store is degraded, or None."""
        if self.breaker.up:
            return None
        return (f"redis down for {self.breaker.down_for():.0f} s ({self.breaker.last_error}): serving from the "
                f"in-process layer, {len(self.queue)} write(s) queued, {self.dropped} dropped")

    # ---- internals ----------------------------------------------------------------------------------------

    def _call(self, op: str, *args):
        try:
            reply = self.script(args=[self.prefix, op, self.origin, self.stream_len, *args])
        except LINK_ERRORS as exc:
            self.breaker.failure(exc)
            raise
        self.breaker.success()
        return reply

    def _require_up(self) -> None:
        if not self.breaker.up:
            raise StoreUnavailable(f"redis is down ({self.breaker.last_error})")

    def _enqueue(self, op: str, what: object) -> None:
        with self.queue_lock:
            if len(self.queue) >= self.queue_size:
                self.queue.popleft()
                self.dropped += 1
            self.queue.append((op, what))

    def _totals(self, totals: list) -> None:
        count, flat = totals
        tenants = {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}
        self.quota.set_totals(tenants, int(count))

    def read_totals(self) -> None:
        """Refresh the usage mirror from Redis (the follower, after other replicas wrote)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hlen(f"{self.prefix}:ids")
        pipe.hgetall(f"{self.prefix}:bytes")
        count, tenants = pipe.execute()
        self.quota.set_totals({k.decode(): int(v) for k, v in tenants.items()}, int(count))

