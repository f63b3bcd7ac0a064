"""Single-flight: concurrent misses for one request, or for a pending semantic neighbour, wait for one computation."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from strata.cache.request.keys import RequestKey
from strata.cache.request.request import AnswerMeta

RELEASED = object()     # the leader gave up without an answer (cancelled): followers retry on their own


@dataclass(slots=True, eq=False)
class Flight:
    """One computation in progress; followers await its future (text, RELEASED, or the leader's exception)."""

    key: RequestKey
    future: asyncio.Future = field(repr=False)
    embedding: np.ndarray | None = field(default=None, repr=False)
    followers: int = 0
    following: bool = False     # its leader waits on another flight: nobody may wait on it in turn (no cycles)
    layer: str = "miss"         # how the leader got its answer (a cache layer, or "miss": computed)
    similarity: float = 1.0     # the leader's hit similarity (1.0 when it computed), passed on to its followers
    meta: AnswerMeta | None = None  # the answer's finish reason and token count, passed on with it
    origin: str | None = None   # the client request that leads it: its other questions never wait on it


class SingleFlight:
    """Pending computations by literal key, on one event loop."""

    def __init__(self) -> None:
        self.flights: dict[str, Flight] = {}

    def join(self, key: RequestKey, origin: str | None = None) -> tuple[Flight | None, bool]:
        """The flight for key and whether the caller leads it (True: compute, then finish; False: await it).
        (None, False) when the flight is led by the caller's own request (origin): a request's answers are computed
        together, after all its lookups, so waiting on it would wait on itself."""
        loop = asyncio.get_running_loop()
        flight = self.flights.get(key.flight)
        if flight is not None and flight.future.get_loop() is loop:
            if origin is not None and flight.origin == origin:
                return None, False
            flight.followers += 1
            return flight, False
        flight = self.flights[key.flight] = Flight(key, loop.create_future(), origin=origin)
        return flight, True

    def pending(self, flight: Flight, min_similarity: float) -> list[tuple[Flight, float]]:
        """Other pending flights of flight's partition that may be waited on, at cosine >= min_similarity to it,
        closest first. Whether one may answer flight is the semantic layer's decision, not this one's."""
        found = []
        for other in self.flights.values():
            if other is flight or other.following or other.embedding is None or other.key.partition != flight.key.partition:
                continue
            if flight.origin is not None and other.origin == flight.origin:     # the same request: it would wait on itself
                continue
            similarity = float(np.dot(other.embedding, flight.embedding))
            if similarity >= min_similarity:
                found.append((other, similarity))
        return sorted(found, key=lambda pair: -pair[1])

    def follow(self, flight: Flight, other: Flight) -> bool:
        """Mark flight as waiting on other; False when other now waits on a flight itself (no cycles, no chains)."""
        if other.following:
            return False
        other.followers += 1
        flight.following = True
        return True

    def finish(self, flight: Flight, outcome: object, *, until_stored: bool = False) -> None:
        """Resolve a flight with a text, RELEASED, or an exception; safe to call from another thread.

        until_stored: the answer is on its way to the store; the flight stays joinable (a repeat gets the answer at
        once, as "shared") until drop() says the write landed or was skipped, so no repeat falls into the gap."""
        if not until_stored and self.flights.get(flight.key.flight) is flight:
            del self.flights[flight.key.flight]

        def resolve() -> None:
            if flight.future.done():
                return
            if isinstance(outcome, BaseException):
                flight.future.set_exception(outcome)
                flight.future.exception()       # mark retrieved: a flight nobody followed must not log
            else:
                flight.future.set_result(outcome)

        loop = flight.future.get_loop()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            resolve()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(resolve)

    def drop(self, flight: Flight) -> None:
        """Forget a flight: one kept by finish(until_stored=True), from the writer thread (the removal runs on the
        flight's loop, after the finish() that kept it), or a hung one, on its loop (removed at once, so the next
        request leads afresh)."""

        def remove() -> None:
            if self.flights.get(flight.key.flight) is flight:
                del self.flights[flight.key.flight]

        loop = flight.future.get_loop()
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if loop.is_closed() or on_loop:
            remove()
        else:
            loop.call_soon_threadsafe(remove)

    def drop_answered(self) -> None:
        """Forget every flight kept for its write (an invalidation: their answers may be the stale ones)."""
        for flight in list(self.flights.values()):
            if flight.future.done():
                self.drop(flight)
