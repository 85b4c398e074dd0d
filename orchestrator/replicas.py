"""Several replicas of one model service behind one client: each session's
calls go to one replica, so that its KV cache is built once and reused there.

A session is placed by rendezvous hashing of its route key over the replicas'
addresses: every orchestrator replica, given the same addresses, sends a
session to the same model replica without sharing any state, and a replica
that goes away, or one that joins, moves only the sessions that were or will
be its own. The route key is the session's cache id, except for a copy of
another session's caches (ForkSession: prefix reuse), whose cache id carries
its source's key (`copy_id`), so that the copy is made, and then used, where
its source's caches are.

The replicas are a list of addresses, or a DNS name (dns:///NAME:PORT) whose
every address is a replica, looked up again every REFRESH_S (a Kubernetes
headless Service lists its ready pods so).

New sessions go to the least busy replicas, counting every orchestrator's
sessions there (orchestrator.replica_load, which Replicas mixes in).

A replica that does not answer (UNAVAILABLE, or past the call's deadline) is
set aside for DOWN_S. The call fails as a cache miss while another replica is
there: the decoder then re-syncs the session, sending its whole committed
prefix, and that call goes to the session's next replica, which prefills it
(DESIGN §2.2: a stale or missing cache costs time, never an output). Only when
every replica is set aside does the call fail as the service being
unavailable, as it does with one replica.

Every replica must serve the same model: at pairing (model_info) the replicas
that answer are compared, and a replica that first answers later, or joins
later, is compared before its first call; one that differs takes no calls.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import socket
import time
from dataclasses import dataclass, field
from typing import Callable

from orchestrator.backends import ServiceCacheMiss, ServiceUnavailable
from orchestrator.config import DNS_PREFIX, dns_target, split_addresses
from orchestrator.replica_load import LOAD_S, ReplicaLoads, route_key
from tandem import telemetry
from tandem.v1 import common_pb2

log = logging.getLogger(__name__)

DOWN_S = 5.0  # how long a replica that did not answer takes no calls
REFRESH_S = 10.0  # how often a DNS name's addresses are looked up again


def identity(info: common_pb2.ModelInfo) -> tuple:
    """What replicas of one service must share: the model, its tokenizer, its
    shape, and what its messages mean (wire_version)."""
    return info.model_id, info.tokenizer_fingerprint, info.vocab_size, info.max_context, info.wire_version


def _describe(info: common_pb2.ModelInfo) -> str:
    return (f"{info.model_id!r} (tokenizer {info.tokenizer_fingerprint[:12]}, vocab {info.vocab_size}, "
            f"context {info.max_context}, wire version {info.wire_version})")


async def resolve(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to, as "ip:port" ("[ip]:port" for IPv6), sorted."""
    found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({f"[{a[4][0]}]:{port}" if a[0] == socket.AF_INET6 else f"{a[4][0]}:{port}" for a in found})


@dataclass(eq=False)
class Replica:
    client: object  # GrpcProposer or GrpcVerifier
    down_until: float = 0.0  # takes no calls before this time (it did not answer)
    checked: bool = False  # its model is the reference's
    refused: str = ""  # why it takes no calls: it serves another model
    running: dict = field(default_factory=dict)  # route key -> its calls in flight here
    held: dict = field(default_factory=dict)  # route key -> its requests running (Replicas.hold), here
    placed: dict = field(default_factory=dict)  # route key -> when a new session was placed here, until its first call
    others: int = 0  # the other orchestrators' sessions here (orchestrator.load_board) ...
    others_at: float = -math.inf  # ... as read at this time

    @property
    def address(self) -> str:
        return self.client.address


class Replicas(ReplicaLoads):
    """The Proposer or Verifier protocol (orchestrator.backends) over several
    replicas of one service. `make(address)` builds a replica's client
    (GrpcProposer or GrpcVerifier); `addresses` are theirs, or `dns` names
    them ((host, port)). `role` names the service in errors ("draft", "target")."""

    relays = False  # the target's relay (--relay on) dials one draft address: not with replicas

    def __init__(self, make: Callable[[str], object], role: str, addresses: list[str] = (),
                 dns: tuple[str, int] | None = None, clock: Callable[[], float] = time.monotonic,
                 close_after_s: float = 120.0, load_s: float = LOAD_S):
        self.make, self.role, self.dns, self.clock = make, role, dns, clock
        self.load_s = load_s  # how often the loads are shared (with a board); 0: never (only the own count)
        self.board = None  # orchestrator.load_board.LoadBoard: the other orchestrators' sessions
        self.close_after_s = close_after_s  # a replica that left is closed once its calls are done
        self.replicas = [Replica(make(address)) for address in addresses]
        self.address = f"{DNS_PREFIX}{dns[0]}:{dns[1]}" if dns else ",".join(addresses)
        self.reference: common_pb2.ModelInfo | None = None  # the model every replica must serve
        self.moves = 0  # calls that failed over to another replica
        self._refresher: asyncio.Task | None = None
        self._loads: asyncio.Task | None = None  # polls the replicas' loads (LOAD_S)
        self._leaving: dict[asyncio.Task, object] = {}  # clients of replicas that left, closed later
        telemetry.watch_replicas(self)

    @property
    def clients(self) -> list:
        return [replica.client for replica in self.replicas]

    # --- membership (dns) --------------------------------------------------------
    async def refresh(self) -> None:
        """Looks the DNS name up again: addresses that appeared join, those that
        went leave (their clients closed once their calls had time to end)."""
        try:
            addresses = await resolve(*self.dns)
        except OSError as err:
            log.warning("%s replicas: %s%s:%d does not resolve (%s); keeping %d", self.role, DNS_PREFIX,
                        *self.dns, err, len(self.replicas))
            return
        self.update(addresses)

    def update(self, addresses: list[str]) -> None:
        known = {replica.address: replica for replica in self.replicas}
        gone = [replica for address, replica in known.items() if address not in addresses]
        joined = [address for address in addresses if address not in known]
        if not gone and not joined:
            return
        self.replicas = [known[a] if a in known else Replica(self.make(a)) for a in addresses]
        log.info("%s replicas now %s (joined %s, left %s)", self.role, addresses or "none", joined or "none",
                 [replica.address for replica in gone] or "none")
        for replica in gone:
            task = asyncio.get_running_loop().create_task(self._close_later(replica.client))
            self._leaving[task] = replica.client
            task.add_done_callback(lambda done: self._leaving.pop(done, None))

    async def _close_later(self, client) -> None:
        await asyncio.sleep(self.close_after_s)
        await client.close()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            await self.refresh()

    # --- placement ---------------------------------------------------------------
    def order(self, cache_id: str) -> list[Replica]:
        """The replicas in the session's order of preference (rendezvous hashing)."""
        key = route_key(cache_id)
        return sorted(self.replicas, reverse=True, key=lambda replica: hashlib.blake2b(
            f"{self.role}\0{replica.address}\0{key}".encode(), digest_size=8).digest())

    def usable(self, replica: Replica) -> bool:
        return not replica.refused and self.clock() >= replica.down_until

    def replica_for(self, cache_id: str) -> Replica:
        """Where the session's next call goes: its first usable replica, else
        its first that serves the model (which then fails the call)."""
        order = self.order(cache_id)
        if not order:
            raise ServiceUnavailable(f"no {self.role} replica: {self.address} resolves to no address")
        for replica in order:
            if self.usable(replica):
                return replica
        return next((replica for replica in order if not replica.refused), order[0])

    # --- calls -------------------------------------------------------------------
    async def _call(self, cache_id: str, call):
        """call(client) on the session's replica; a replica that does not
        answer is set aside, and the call fails as a cache miss while another
        one is usable (the decoder re-syncs, and that goes to the next one)."""
        replica = self.replica_for(cache_id)
        if not replica.checked and self.reference is not None:
            await self._check(replica)
            replica = self.replica_for(cache_id)
        key = route_key(cache_id)
        replica.running[key] = replica.running.get(key, 0) + 1
        replica.placed.pop(key, None)
        if key not in replica.held:
            self._follow(key, replica)
        try:
            return await call(replica.client)
        except ServiceUnavailable as err:
            replica.down_until = self.clock() + DOWN_S
            if not any(self.usable(other) for other in self.replicas):
                raise
            self.moves += 1
            telemetry.instruments().replica_failovers.add(1, {"service": self.role})
            log.warning("%s replica %s did not answer (%s): its sessions move to the others for %gs",
                        self.role, replica.address, err, DOWN_S)
            raise ServiceCacheMiss(f"{self.role} replica {replica.address} unavailable: {err}") from None
        finally:
            if (left := replica.running.pop(key) - 1) > 0:
                replica.running[key] = left

    async def _check(self, replica: Replica) -> None:
        """Compares a replica's model with the reference before its first call."""
        try:
            info = await replica.client.model_info()
        except ServiceUnavailable:
            replica.down_until = self.clock() + DOWN_S
            return
        self._compare(replica, info)

    def _compare(self, replica: Replica, info: common_pb2.ModelInfo) -> None:
        if identity(info) == identity(self.reference):
            replica.checked = True
            if info.dtype != self.reference.dtype:
                log.warning("%s replica %s computes in %s, the first in %s: a greedy output may differ by replica",
                            self.role, replica.address, info.dtype, self.reference.dtype)
        elif not replica.refused:
            replica.refused = (f"{self.role} replica {replica.address} serves {_describe(info)}, "
                               f"the others {_describe(self.reference)}")
            log.error("%s: it takes no calls", replica.refused)

    async def propose(self, session_id, *args, **kwargs):
        return await self._call(session_id, lambda client: client.propose(session_id, *args, **kwargs))

    async def verify(self, session_id, *args, **kwargs):
        return await self._call(session_id, lambda client: client.verify(session_id, *args, **kwargs))

    async def release(self, session_id: str) -> None:
        if self.replicas:
            await self.replica_for(session_id).client.release(session_id)

    async def fork(self, source_id: str, session_id: str, prefix) -> bool:
        """Copies on the source's replica, where the copy's id (copy_id) places it too."""
        if not self.replicas:
            return False
        replica = self.replica_for(source_id)
        if self.replica_for(session_id) is not replica or not self.usable(replica):
            return False
        return await replica.client.fork(source_id, session_id, prefix)

    async def model_info(self) -> common_pb2.ModelInfo:
        """The model the replicas serve, as the first in the list that answers
        reports it; the others that answer must serve the same one. Raises
        ServiceUnavailable when none answers, ValueError when they differ.
        With a DNS name, looks it up first, then every REFRESH_S."""
        if self.dns is not None:
            await self.refresh()
            if self._refresher is None:
                self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())
        if self._loads is None and self.sharing:
            self._loads = asyncio.get_running_loop().create_task(self._poll_loads_forever())
        replicas = list(self.replicas)
        if not replicas:
            raise ServiceUnavailable(f"no {self.role} replica: {self.address} resolves to no address")
        answers = await asyncio.gather(*(replica.client.model_info() for replica in replicas),
                                       return_exceptions=True)
        for answer in answers:
            if not isinstance(answer, (common_pb2.ModelInfo, ServiceUnavailable)):
                raise answer
        infos = [(replica, info) for replica, info in zip(replicas, answers) if isinstance(info, common_pb2.ModelInfo)]
        if not infos:
            raise ServiceUnavailable(f"no {self.role} replica answers at {self.address}: "
                                     + "; ".join(f"{r.address}: {e}" for r, e in zip(replicas, answers)))
        first = infos[0][1]
        if any(identity(info) != identity(first) for _, info in infos):
            raise ValueError(f"the {self.role} replicas serve different models: "
                             + "; ".join(f"{replica.address} {_describe(info)}" for replica, info in infos))
        self.reference = first
        for replica, info in infos:
            self._compare(replica, info)
        for replica, answer in zip(replicas, answers):
            if isinstance(answer, ServiceUnavailable):
                log.warning("%s replica %s does not answer yet: it takes calls once it does", self.role,
                            replica.address)
        return self.reference

    async def stats(self) -> list:
        return await asyncio.gather(*(replica.client.stats() for replica in self.replicas))

    async def close(self) -> None:
        for task in (self._refresher, self._loads):
            if task is not None:
                task.cancel()
        leaving = list(self._leaving.items())
        for task, _ in leaving:
            task.cancel()
        await asyncio.gather(*(client.close() for client in [*self.clients, *(client for _, client in leaving)]))
        if self._loads is not None:  # the others stop counting this orchestrator's sessions at once
            try:
                await asyncio.wait_for(self.board.leave(), 1.0)
            except Exception as err:  # noqa: BLE001 (its entry goes stale in 3 x load_s anyway)
                log.debug("%s replicas: could not leave the load board (%s)", self.role, err)


def service_client(value: str, make: Callable[[str], object], role: str, load_s: float = LOAD_S):
    """The client of a service given as one address (its own client), several
    comma-separated, or a DNS name (dns:///NAME:PORT): Replicas, which share
    their loads every load_s once given a board (0: never)."""
    if value.startswith(DNS_PREFIX):
        return Replicas(make, role, dns=dns_target(value), load_s=load_s)
    addresses = split_addresses(value)
    return make(addresses[0]) if len(addresses) == 1 else Replicas(make, role, addresses, load_s=load_s)
