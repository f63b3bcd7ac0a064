"""Keeps one replica in step with the others: a thread reads the Redis stream of writes and invalidations (XREAD
BLOCK) and hands the other replicas' events to the cache; when Redis was down, or the stream was trimmed past what it
had read (a gap), it flushes the queued writes and has the cache rebuild its index with SCAN before closing the
breaker again."""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import redis

from strata.cache.request.redis_store import LINK_ERRORS

if TYPE_CHECKING:
    from strata.cache.request.redis_store import RedisStore, StoreListener

log = logging.getLogger(__name__)

BLOCK_MS = 200          # one XREAD waits this long for events; also how soon stop() is noticed
RETRY_S = 0.5           # probe interval while Redis is down


def _id(raw: bytes | str) -> tuple[int, int]:
    ms, _, seq = (raw.decode() if isinstance(raw, bytes) else raw).partition("-")
    return int(ms), int(seq or 0)


class StreamFollower:
    """One daemon thread per store; lag_s is how old the latest event was when it arrived (delivery delay)."""

    def __init__(self, store: RedisStore, listener: StoreListener):
        self.store, self.listener = store, listener
        self.stream = f"{store.prefix}:stream"
        # XREAD BLOCK holds its socket longer than a normal call may: a connection of its own
        self.redis = store.redis.__class__(connection_pool=store.redis.connection_pool.__class__(
            **{**store.redis.connection_pool.connection_kwargs,
               "socket_timeout": store.timeout_s + BLOCK_MS / 1000}))
        self.last: bytes | None = None   # the last event read
        self.added = 0                    # how many events the stream ever held up to and including self.last
        self.lag_s = 0.0
        self.resyncs = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, name="request-cache-redis-sync", daemon=True)

    def start(self) -> None:
        """First sync here (when Redis answers), then follow on the thread."""
        self.recover()
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        self.redis.close()

    def run(self) -> None:
        while not self.stopped.is_set():
            if not self.store.breaker.up and not self.recover():
                self.stopped.wait(RETRY_S)
                continue
            try:
                self.follow()
            except LINK_ERRORS as exc:
                self.store.breaker.failure(exc, trip=True)
            except Exception:           # a bug in a listener must not end replication for good
                log.exception("redis stream follower failed; resyncing")
                self.last = None
                self.stopped.wait(RETRY_S)

    def recover(self) -> bool:
        """Probe, flush the queued writes, note the stream's tail, rebuild the index, close the breaker."""
        try:
            self.redis.ping()
            if not self.store.flush():
                return False
            try:
                info = self.redis.xinfo_stream(self.stream)         # tail and count of one moment
                self.last, self.added = info["last-generated-id"], info["entries-added"]
            except redis.ResponseError:                             # no stream yet: nothing written
                self.last, self.added = b"0-0", 0
            self.store.breaker.close()          # entries() and get() below need the link up
            self.listener.resync()
            self.store.read_totals()
        except LINK_ERRORS as exc:
            self.store.breaker.failure(exc, trip=True)
            return False
        except Exception as exc:        # a bug: Redis stays marked down (health says so) and the probe retries
            log.exception("request-cache redis %s: resync failed", self.store.url)
            self.store.breaker.failure(exc, trip=True)
            return False
        self.resyncs += 1
        log.info("request-cache redis %s: in sync (%d resyncs)", self.store.url, self.resyncs)
        return True

    def follow(self) -> None:
        """One XREAD: dispatch the other replicas' events; a gap (trimmed past our position) means resync."""
        if self.last is None:
            self.store.breaker.failure(RuntimeError("stream position lost"), trip=True)
            return
        reply = self.redis.xread({self.stream: self.last}, count=1000, block=BLOCK_MS)
        if not reply:
            return
        events = reply[0][1]
        info = self.redis.xinfo_stream(self.stream)
        if self.added + 1 < info["entries-added"] - info["length"] + 1:     # the next one we need was trimmed
            log.warning("request-cache redis stream trimmed past this replica's position: resyncing")
            self.store.breaker.failure(RuntimeError("stream gap"), trip=True)
            return
        for event_id, fields in events:
            self.last = event_id
            self.added += 1
            if fields.get(b"origin", b"").decode() == self.store.origin:
                continue
            ids = fields[b"ids"].decode().split(",")
            if fields[b"op"] == b"put":
                for entry_id in ids:
                    self.listener.stored_elsewhere(entry_id)
            else:
                self.listener.deleted_elsewhere(ids)
        self.lag_s = max(0.0, time.time() - _id(events[-1][0])[0] / 1000)
        self.store.read_totals()
