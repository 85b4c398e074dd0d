"""Calls of several sessions run as one batch on a model worker: the target's
verifies (--batch-verifies) and the draft's blocks (--batch-drafts).

A call that finds no batch running goes to the worker at once, alone:
batching adds no wait. Those that arrive while one runs queue, and go
together, up to max_batch of them (one a session), as soon as it ends: under
load the model reads its weights once for several sessions instead of once
each. Where more queue than a batch holds, the lowest priority goes first
(priority_of, the requests' --scheduling-policy priority), ties in arrival
order; a batch takes its most urgent call's place in the worker's queue.
"""
from __future__ import annotations

import asyncio
from typing import Callable, Generic, TypeVar

from tandem.serving import ModelWorker

C = TypeVar("C")
R = TypeVar("R")


class CallBatcher(Generic[C, R]):
    """run_batch(calls) runs on the worker and returns each call's result, or
    the exception that call alone raises; session_of(call) names the session
    a call works on (a batch holds one call a session); priority_of(call) its
    request's priority (lower first)."""

    def __init__(self, worker: ModelWorker, run_batch: Callable[[list[C]], list[R | Exception]], max_batch: int,
                 session_of: Callable[[C], str], priority_of: Callable[[C], int] = lambda call: 0):
        if max_batch < 2:
            raise ValueError(f"a batch holds at least 2 calls, got {max_batch}")
        self.worker = worker
        self.run_batch = run_batch
        self.max_batch = max_batch
        self.session_of = session_of
        self.priority_of = priority_of
        self._pending: list[tuple[C, asyncio.Future]] = []
        self._running = False
        self.batches = 0  # batches run, and the calls they held (ServiceStats)
        self.batched_calls = 0

    @property
    def waiting(self) -> int:
        """Calls submitted that wait for a batch (not the running one's)."""
        return len(self._pending)

    async def submit(self, call: C) -> R:
        """The call's result, or the exception it raises (a cache miss, say)."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((call, future))
        if not self._running:
            self._launch()
        return await future

    def _launch(self) -> None:
        batch, later, sessions = [], [], set()
        for call, future in sorted(self._pending, key=lambda pending: self.priority_of(pending[0])):  # stable
            if future.cancelled():
                continue  # its caller went away before it ran
            session = self.session_of(call)
            if len(batch) < self.max_batch and session not in sessions:
                batch.append((call, future))
                sessions.add(session)
            else:
                later.append((call, future))
        self._pending = later
        if not batch:
            return
        self._running = True
        task = asyncio.ensure_future(self.worker.run(self.run_batch, [call for call, _ in batch],
                                                     priority=min(self.priority_of(call) for call, _ in batch)))
        task.add_done_callback(lambda done: self._finish(batch, done))

    def _finish(self, batch, task: asyncio.Task) -> None:
        self._running = False
        self.batches += 1
        self.batched_calls += len(batch)
        error = task.exception() if not task.cancelled() else asyncio.CancelledError()
        results = task.result() if error is None else [error] * len(batch)
        for (_, future), result in zip(batch, results):
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
        if self._pending:
            self._launch()
