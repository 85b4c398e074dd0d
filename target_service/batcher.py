"""Verifies of several sessions in one forward (--batch-verifies).

A verify that finds no other verify running goes to the model worker at once,
alone: batching adds no wait. Those that arrive while one runs queue, and go
together, up to max_batch of them, as soon as it ends: under load the target
reads its weights once for several sessions' blocks instead of once each.
"""
from __future__ import annotations

import asyncio
import logging

from tandem.serving import ModelWorker
from target_service.verifier import Verifier, VerifyCall, VerifyOutcome

log = logging.getLogger(__name__)


class VerifyBatcher:
    def __init__(self, worker: ModelWorker, verifier: Verifier, max_batch: int):
        if max_batch < 2:
            raise ValueError(f"a batch holds at least 2 verifies, got {max_batch}")
        self.worker = worker
        self.verifier = verifier
        self.max_batch = max_batch
        self._pending: list[tuple[VerifyCall, asyncio.Future]] = []
        self._running = False
        self.batches = 0  # forwards run, and the verifies they held (ServiceStats)
        self.batched_calls = 0

    async def verify(self, call: VerifyCall) -> VerifyOutcome:
        """The call's outcome, or the exception its verify raises (a cache miss, say)."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((call, future))
        if not self._running:
            self._launch()
        return await future

    def _launch(self) -> None:
        batch, later, sessions = [], [], set()
        for call, future in self._pending:
            if future.cancelled():
                continue  # its caller went away before it ran
            if len(batch) < self.max_batch and call.session_id not in sessions:
                batch.append((call, future))
                sessions.add(call.session_id)
            else:
                later.append((call, future))
        self._pending = later
        if not batch:
            return
        self._running = True
        task = asyncio.ensure_future(self.worker.run(self.verifier.verify_batch, [call for call, _ in batch]))
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
