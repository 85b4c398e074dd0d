"""How busy each model replica is, and where a new session goes: the load
half of orchestrator.replicas.Replicas, which mixes ReplicaLoads in.

New sessions go to the least busy replicas (placed_id). A replica's load is
this orchestrator's sessions there (a request counts from its start to its
end: hold), plus every other orchestrator's, which they share through Redis
every LOAD_S and as they place a session, the placement itself chosen on the
board in one script (orchestrator.load_board). So orchestrator replicas behind
one Service spread their sessions over the model replicas together, not each
on its own, even when they place at the same moment.
"""
from __future__ import annotations

import asyncio
import logging
import random
import uuid
from typing import Callable

log = logging.getLogger(__name__)

PLACED_S = 5.0  # a new session counts on its replica this long before its first call
PLACE_WAIT_S = 0.25  # how long a new session's placement waits for the board's choice
LOAD_S = 1.0  # how often the loads are shared on the board; a reading older than 3 x LOAD_S is not used
SEPARATOR = "~"  # in a copy's cache id, before the route key it shares with its source


def route_key(cache_id: str) -> str:
    """The part of a cache id that places the session: its source's key for a copy."""
    return cache_id.rpartition(SEPARATOR)[2]


def copy_id(source_cache_id: str) -> str:
    """A new cache id placed where `source_cache_id` is, for a copy of its caches."""
    return f"{uuid.uuid4().hex}{SEPARATOR}{route_key(source_cache_id)}"


class ReplicaLoads:
    """Mixed into Replicas, whose replicas (each a replicas.Replica with its
    held, running, placed and others counts), role, clock, board, load_s,
    usable() and replica_for() it uses."""

    # --- load --------------------------------------------------------------------
    def share_loads(self, board) -> None:
        """Shares this orchestrator's loads with the others' on `board` (a
        LoadBoard), every load_s from pairing (model_info) on."""
        self.board = board

    async def poll_loads(self) -> None:
        """Writes this orchestrator's sessions per replica to the board and
        reads the others'. Where Redis does not answer, the last reading
        stands until it is stale (3 x load_s), then only the own count."""
        own = {replica.address: self.own(replica) for replica in self.replicas}
        try:
            others = await self.board.share(own)
        except Exception as err:  # noqa: BLE001 (a missed poll costs only freshness)
            log.debug("%s replicas: the load board did not answer (%s)", self.role, err)
            return
        self._read(others)

    @property
    def stale_s(self) -> float:
        """How old a reading of the board (or an entry on it) may be and still count."""
        return 3 * (self.load_s or LOAD_S)

    def _read(self, others: dict[str, int]) -> None:
        """The other orchestrators' sessions per replica, as just read from the board."""
        read = self.clock()
        for replica in self.replicas:
            replica.others, replica.others_at = others.get(replica.address, 0), read

    def _others(self, replica) -> int:
        """The other orchestrators' sessions on the replica, while the reading is fresh."""
        return replica.others if self.clock() - replica.others_at <= self.stale_s else 0

    def loads(self) -> dict[str, tuple[int, int]]:
        """Each replica's address: (this orchestrator's sessions there, every
        orchestrator's as placement counts them). Read by the metrics from their
        own thread: it changes nothing."""
        loads = {}
        for replica in list(self.replicas):
            own = _sessions(replica)
            loads[replica.address] = (own, own + self._others(replica))
        return loads

    @property
    def sharing(self) -> bool:
        return self.board is not None and self.load_s > 0

    async def reserve(self) -> list | None:
        """Before a new session is placed: the least busy usable replica, as
        the board chooses it, counting every orchestrator's sessions, with the
        new session written there at once (LoadBoard.place); None without a
        board, or when Redis does not answer within PLACE_WAIT_S (then
        least_busy() places it, by the last reading)."""
        usable = [replica for replica in self.replicas if self.usable(replica)]
        if not self.sharing or not usable:
            return None
        random.shuffle(usable)  # the board takes the first of the least busy
        own = {replica.address: self.own(replica) for replica in self.replicas}
        try:
            chosen, others = await asyncio.wait_for(
                self.board.place(own, [replica.address for replica in usable]), PLACE_WAIT_S)
        except Exception as err:  # noqa: BLE001 (placed by the last reading instead)
            log.debug("%s replicas: no placement from the load board (%s)", self.role, err)
            return None
        self._read(others)
        return [replica for replica in usable if replica.address == chosen] or None

    async def _poll_loads_forever(self) -> None:
        while True:
            await self.poll_loads()
            await asyncio.sleep(self.load_s)

    def own(self, replica) -> int:
        """This orchestrator's sessions on the replica: those whose request
        runs (hold), or with a call in flight there, and those placed there in
        the last PLACED_S seconds whose request has not started yet."""
        since = self.clock() - PLACED_S
        for key in [key for key, at in replica.placed.items() if at < since]:
            del replica.placed[key]
        return _sessions(replica)

    # A request counts on its session's replica from start to end (between two
    # of its calls to this service, none is in flight: the other service works).
    def hold(self, cache_id: str) -> None:
        """A request of the session starts: it counts on its replica until unhold."""
        key = route_key(cache_id)
        replica = self.replica_for(cache_id) if self.replicas else None
        if replica is not None:
            replica.held[key] = replica.held.get(key, 0) + 1
            replica.placed.pop(key, None)

    def unhold(self, cache_id: str) -> None:
        key = route_key(cache_id)
        for replica in self.replicas:
            if key in replica.held:
                if (left := replica.held.pop(key) - 1) > 0:
                    replica.held[key] = left
                return

    def _follow(self, key: str, replica) -> None:
        """A held session whose call went to another replica (its own was set
        aside) counts there from now on."""
        for other in self.replicas:
            if other is not replica and key in other.held:
                replica.held[key] = replica.held.get(key, 0) + other.held.pop(key)

    def active(self, replica) -> int:
        """The replica's load in sessions: this orchestrator's, and the other
        orchestrators' as last read from the board, while that is fresh
        (3 x load_s)."""
        return self.own(replica) + self._others(replica)

    def least_busy(self) -> list:
        """The usable replicas with the fewest active sessions."""
        loads = {replica: self.active(replica) for replica in self.replicas if self.usable(replica)}
        return [replica for replica, load in loads.items() if load == min(loads.values())] if loads else []

    def place(self, key: str) -> None:
        """Counts a new session on its replica until its first call."""
        if self.replicas:
            self.replica_for(key).placed[route_key(key)] = self.clock()

    def crowded(self, cache_id: str) -> bool:
        """Whether the session's replica runs well over the least busy usable
        one's sessions (more than twice as many, plus two): a copy of its
        caches is then not worth making there, and a new session is placed
        afresh instead."""
        loads = [self.active(replica) for replica in self.replicas if self.usable(replica)]
        return bool(loads) and self.active(self.replica_for(cache_id)) > 2 * min(loads) + 2


def _sessions(replica) -> int:
    """This orchestrator's sessions on the replica, as its dicts stand: held,
    with a call in flight, or placed (Replicas.own prunes the placed first)."""
    return len(replica.held.keys() | replica.running.keys() | replica.placed.keys())


def hold(clients, cache_id: str) -> Callable[[], None]:
    """A request of the session starts: it counts on its replica of each
    replicated service (Replicas.hold) until the function returned is called;
    a plain client has nothing to count."""
    replicated = [client for client in clients if isinstance(client, ReplicaLoads)]
    for client in replicated:
        client.hold(cache_id)

    def unhold() -> None:
        for client in replicated:
            client.unhold(cache_id)

    return unhold


async def placed_on_board(services: list[ReplicaLoads], lock: asyncio.Lock) -> str:
    """A new session's cache id (placed_id), each service's replica chosen
    on its load board where it answers (Replicas.reserve). One placement of
    an orchestrator at a time (`lock`, its own): the next one's count then
    holds this one, which the board alone would not (a placement writes this
    orchestrator's whole count, as it stood when it was sent)."""
    async with lock:
        return placed_id(services, list(await asyncio.gather(*(service.reserve() for service in services))))


def placed_id(services: list[ReplicaLoads], wanted: list | None = None, tries: int = 512) -> str:
    """A new session's cache id, placed on the least busy replica of the
    first service (the target), and where it can, of the others too (the
    draft): the first of up to `tries` random ids that the rendezvous order
    puts there. Load-aware where rendezvous hashing alone is not: a few
    sessions at once would land unevenly. `wanted`: each service's replicas
    to place it on (Replicas.reserve), where not None; else its least busy.
    "" without replicas."""
    if not services:
        return ""
    wanted = [want if want is not None else service.least_busy()
              for service, want in zip(services, wanted or [None] * len(services))]
    fallback = ""
    for _ in range(tries):
        key = uuid.uuid4().hex
        hits = [not want or service.replica_for(key) in want for service, want in zip(services, wanted)]
        if all(hits):
            fallback = key
            break
        if hits[0] and not fallback:
            fallback = key
    fallback = fallback or uuid.uuid4().hex
    for service in services:
        service.place(fallback)
    return fallback
