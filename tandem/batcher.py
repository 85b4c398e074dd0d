"""Calls of several sessions run as one batch on a model worker: the target's
verifies (--batch-verifies) and the draft's blocks (--batch-drafts).

A call that finds no batch running goes to the worker at once, alone, by
the path it takes without batching (its `alone`: the same span, inline rule,
cancellation and queue place): batching adds no wait and changes nothing for
a lone stream. Those that arrive while one runs queue, and go together, up
to max_batch of them (one a session), as soon as it ends: under load the
model reads its weights once for several sessions instead of once each. A
queue of one goes alone again. Where more queue than a batch holds, the
lowest priority goes first (priority_of, the requests' --scheduling-policy
priority), ties in arrival order; a batch takes its most urgent call's place
in the worker's queue, and its span (`span`) lies under that call's.
"""
from __future__ import annotations

import asyncio
import contextvars
from typing import Awaitable, Callable, Generic, TypeVar

from tandem.serving import ModelWorker

C = TypeVar("C")
R = TypeVar("R")
_ALONE = object()  # a pending call's future result: run by yourself


class CallBatcher(Generic[C, R]):
    """run_batch(calls) runs on the worker and returns each call's result, or
    the exception that call alone raises; session_of(call) names the session
    a call works on (a batch holds one call a session); priority_of(call) its
    request's priority (lower first); span: the name of a batch's span."""

    def __init__(self, worker: ModelWorker, run_batch: Callable[[list[C]], list[R | Exception]], max_batch: int,
                 session_of: Callable[[C], str], priority_of: Callable[[C], int] = lambda call: 0,
                 span: str | None = None):
        if max_batch < 2:
            raise ValueError(f"a batch holds at least 2 calls, got {max_batch}")
        self.worker = worker
        self.run_batch = run_batch
        self.max_batch = max_batch
        self.session_of = session_of
        self.priority_of = priority_of
        self.span = span
        # (call, its future, its alone, the submitter's context)
        self._pending: list[tuple[C, asyncio.Future, Callable[[], Awaitable[R]] | None, contextvars.Context]] = []
        self._running = False
        self.batches = 0  # batches run, lone calls included, and the calls they held (ServiceStats)
        self.batched_calls = 0

    @property
    def waiting(self) -> int:
        """Calls submitted that wait for a batch (not the running one's)."""
        return len(self._pending)

    async def submit(self, call: C, alone: Callable[[], Awaitable[R]] | None = None) -> R:
        """The call's result, or the exception it raises (a cache miss, say).
        alone(): runs the call by itself as it would run unbatched (None: as a
        batch of one)."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((call, future, alone, contextvars.copy_context()))
        if not self._running:
            self._launch()
        try:
            result = await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.result() is _ALONE:
                self._release()  # its turn came as it was cancelled: hand the turn on
            raise
        if result is not _ALONE:
            return result
        try:
            return await alone()
        finally:
            self._release()

    def _release(self) -> None:
        """A lone call ended."""
        self._running = False
        self.batches += 1
        self.batched_calls += 1
        if self._pending:
            self._launch()

    def _launch(self) -> None:
        batch, later, sessions = [], [], set()
        for pending in sorted(self._pending, key=lambda pending: self.priority_of(pending[0])):  # stable
            call, future = pending[0], pending[1]
            if future.cancelled():
                continue  # its caller went away before it ran
            session = self.session_of(call)
            if len(batch) < self.max_batch and session not in sessions:
                batch.append(pending)
                sessions.add(session)
            else:
                later.append(pending)
        self._pending = later
        if not batch:
            return
        self._running = True
        if len(batch) == 1 and batch[0][2] is not None:
            batch[0][1].set_result(_ALONE)  # its submitter runs it, and releases the turn
            return
        calls = [call for call, *_ in batch]
        work = self.worker.run(self.run_batch, calls, span=self.span,
                               priority=min(self.priority_of(call) for call in calls))
        task = asyncio.get_running_loop().create_task(work, context=batch[0][3])  # the most urgent call's trace
        task.add_done_callback(lambda done: self._finish(batch, done))

    def _finish(self, batch, task: asyncio.Task) -> None:
        self._running = False
        self.batches += 1
        self.batched_calls += len(batch)
        error = task.exception() if not task.cancelled() else asyncio.CancelledError()
        results = task.result() if error is None else [error] * len(batch)
        for (_, future, *_), result in zip(batch, results):
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
        if self._pending:
            self._launch()
