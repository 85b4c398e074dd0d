"""Drafts begun on the target's verdict (DraftService.Prepare; the relay).

After a verify that rejected a draft token (or whose bonus token was not the
pre-draft's guess), the orchestrator asks the draft for the block after the
verdict: two hops and the orchestrator's own work sit between the verify's
end and the draft's first step. With the relay, the target sends that same
Propose request to the draft the moment it has the verdict
(target_service.relay), and the draft starts at once. The orchestrator's call
still comes, and takes the reply; what it waits for is the rest of the
drafting, no longer the way round.

What the draft keeps is exactly what the call would have computed: the same
cache, the same per-position random draws (tandem.rng), so a prepared reply
can never change an output. A call takes a prepared reply only when it names
the same history, by length and fingerprint, and the same num_tokens,
sampling and return_distributions; a prepare that does not match is cancelled
before the call runs, and one that comes after its call, or for a history
the draft already holds (a pre-draft that hit), or for a session it does not
hold is skipped.

A pre-draft queues behind the drafts an orchestrator waits for
(draft_service.server.queue_place), so after a rejection the relayed draft,
or the orchestrator's own, can run before the pre-draft whose cancel has not
reached the service yet. A pre-draft is dropped when its turn comes
(Overtaken, answered as a cache miss) if a fresh call of its session arrived
after it and that call's history parts from the pre-draft's: the
orchestrator wants it no more, and were it to run it would crop that call's
tokens back to the history it assumed, and the orchestrator's next call
would miss. A later call whose history the pre-draft's extends (a draft
relayed after the request's last verdict, then the next turn's first call)
leaves it to run.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Awaitable, Callable

from draft_service.drafters import Proposal, ProposeCall
from tandem import fingerprint
from tandem.session_cache import CacheMiss, SessionCacheStore

log = logging.getLogger(__name__)
MAX_PENDING = 256  # prepared drafts kept, one a session; the oldest go first
STALE_S = 5.0  # a prepared draft not taken this long after it finished is dropped (its request ended)
MAX_ASKED = 4096  # sessions whose last call's history length is kept


class Overtaken(CacheMiss):
    """A pre-draft whose session had a fresh call after it arrived, on a history that parts from its own."""

    def __init__(self, session_id: str):
        super().__init__(session_id, 0, 0, f"pre-draft of session {session_id} dropped: a later call of the "
                                           "session reached the draft first")


def _fp_at(call: ProposeCall, length: int) -> int:
    """The fingerprint of the call's history cut to `length` (prefix_len <= length <= its history's)."""
    return fingerprint.extend(call.prefix_fp, call.new_tokens[:length - call.prefix_len])


def parts(one: ProposeCall, other: ProposeCall) -> bool:
    """Whether the two calls' histories (prefix + new tokens) differ within
    the shorter's length, where both calls name it; False where that cannot
    be told from the calls (one's prefix is longer than the other's history:
    a checkout of the longer prefix then tells)."""
    length = min(one.prefix_len + len(one.new_tokens), other.prefix_len + len(other.new_tokens))
    if length < max(one.prefix_len, other.prefix_len):
        return False
    return _fp_at(one, length) != _fp_at(other, length)


def history_key(call: ProposeCall) -> tuple:
    """What a prepared reply must share with the call that takes it."""
    length = call.prefix_len + len(call.new_tokens)
    return (length, fingerprint.extend(call.prefix_fp, call.new_tokens), call.num_tokens, call.sampling,
            call.return_dists, call.first_is_bonus_guess, call.alternatives)


def skip_held(store: SessionCacheStore, call: ProposeCall) -> ProposeCall | None:
    """The call with the new tokens the session's cache already holds moved
    into its prefix (all but the last, which a call always brings); None when
    the cache does not hold the call's prefix, or holds its whole history (a
    pre-draft after it hit): nothing to prepare then. Runs on the model thread."""
    cache = store.peek(call.session_id)
    if call.prefix_len == 0 or cache is None or not cache.matches(call.prefix_len, call.prefix_fp):
        return None
    length, fp, new = call.prefix_len, call.prefix_fp, list(call.new_tokens)
    if cache.matches(length + len(new), fingerprint.extend(fp, new)):
        return None
    while len(new) > 1:
        ahead = fingerprint.extend(fp, new[:1])
        if not cache.matches(length + 1, ahead):
            break
        length, fp, new = length + 1, ahead, new[1:]
    return dataclasses.replace(call, prefix_len=length, prefix_fp=fp, new_tokens=new)


@dataclass
class _Pending:
    key: tuple
    task: asyncio.Task  # → (Proposal | None, handler ms beyond compute) ; None: skipped
    done_at: float = 0.0


@dataclass(frozen=True)
class Taken:
    proposal: Proposal
    handler_ms: float  # the time spent on this call in the draft's handlers, its compute included


class Prepared:
    """The prepared drafts of a draft service, one per session at most.

    `run(call, cancelled)` drafts on the model worker: the servicer's
    (ModelWorker.run with its cancel event and inline rule)."""

    def __init__(self, store: SessionCacheStore, run: Callable[[ProposeCall, threading.Event], Awaitable[Proposal]]):
        self.store = store
        self.run = run
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._asked: OrderedDict[str, int] = OrderedDict()  # history length of a session's last fresh call
        # A session's last fresh call (an orchestrator's call that is no
        # pre-draft, or a prepare that began drafting) and its number, from one count.
        self._fresh: OrderedDict[str, tuple[int, ProposeCall]] = OrderedDict()
        self._numbers = itertools.count(1)
        self.received = self.started = self.used = 0  # Prepare requests; those that drafted; replies taken
        self.overtaken = 0  # pre-drafts dropped (check_not_overtaken)

    def begin(self, call: ProposeCall) -> None:
        """Starts drafting for `call` unless its orchestrator call came first."""
        length = call.prefix_len + len(call.new_tokens)
        if call.first_is_bonus_guess or length <= self._asked.get(call.session_id, 0):
            return
        self._drop(call.session_id)
        self._note_fresh(call)
        stale = time.perf_counter() - STALE_S
        for session_id in [s for s, p in self._pending.items() if p.done_at and p.done_at < stale]:
            self._drop(session_id)
        pending = _Pending(history_key(call), asyncio.get_running_loop().create_task(self._draft(call)))
        pending.task.add_done_callback(lambda _: setattr(pending, "done_at", time.perf_counter()))
        self._pending[call.session_id] = pending
        while len(self._pending) > MAX_PENDING:
            self._drop(next(iter(self._pending)))

    async def _draft(self, call: ProposeCall) -> tuple[Proposal | None, float]:
        started = time.perf_counter()
        try:
            proposal = await self.run(call, threading.Event())  # a cancel sets the event (ModelWorker.run)
        except Exception as err:  # a cache miss, an eviction meanwhile: the call will run as usual
            log.debug("prepare for session %s dropped: %s", call.session_id, err)
            return None, 0.0
        if proposal is not None:
            self.started += 1
            return proposal, (time.perf_counter() - started) * 1e3 - proposal.compute_ms
        return None, 0.0

    async def take(self, call: ProposeCall) -> Taken | None:
        """The prepared reply for `call`, waited for; None when there is none,
        after cancelling a prepare that `call` does not match."""
        if not call.first_is_bonus_guess:
            _remember(self._asked, call.session_id, call.prefix_len + len(call.new_tokens))
            self._note_fresh(call)
        pending = self._pending.pop(call.session_id, None)
        if pending is None:
            return None
        if pending.key != history_key(call):
            await _cancelled(pending.task)
            return None
        arrived = time.perf_counter()
        try:
            proposal, beyond_ms = await pending.task
        except Exception:
            return None
        if proposal is None:
            return None
        self.used += 1
        after_ms = (time.perf_counter() - max(arrived, pending.done_at)) * 1e3
        return Taken(proposal, proposal.compute_ms + beyond_ms + max(0.0, after_ms))

    def _note_fresh(self, call: ProposeCall) -> None:
        _remember(self._fresh, call.session_id, (next(self._numbers), call))

    def last_fresh(self, session_id: str) -> int:
        """The number of the session's last fresh call, 0 for none: a pre-draft
        notes it on arrival (after take), for check_not_overtaken."""
        fresh = self._fresh.get(session_id)
        return 0 if fresh is None else fresh[0]

    def check_not_overtaken(self, call: ProposeCall, noted: int) -> None:
        """Raises Overtaken if a fresh call of the pre-draft `call`'s session
        arrived after it (it noted `noted`) on a history that parts from its
        own. Runs on the model thread, just before the pre-draft touches the cache."""
        fresh = self._fresh.get(call.session_id)
        if fresh is not None and fresh[0] != noted and parts(fresh[1], call):
            self.overtaken += 1
            log.debug("pre-draft of session %s overtaken by a later call: dropped", call.session_id)
            raise Overtaken(call.session_id)

    def _drop(self, session_id: str) -> None:
        pending = self._pending.pop(session_id, None)
        if pending is not None:
            pending.task.cancel()

    def release(self, session_id: str) -> None:
        self._drop(session_id)
        self._asked.pop(session_id, None)
        self._fresh.pop(session_id, None)


def _remember(kept: OrderedDict, session_id: str, value) -> None:
    """Keeps a session's latest value, the last MAX_ASKED sessions' at most."""
    kept[session_id] = value
    kept.move_to_end(session_id)
    while len(kept) > MAX_ASKED:
        kept.popitem(last=False)


async def _cancelled(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
