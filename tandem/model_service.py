"""What the draft and target services have in common: configuration, the
session cache store, the model worker, request checks and the shared rpcs
(GetModelInfo, ReleaseSession, GetStats)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable

import grpc
import torch

from tandem import fingerprint, placement, serving, telemetry
from tandem.grammar import GrammarMasks, GrammarUnavailable
from tandem.modeling import LoadedModel
from tandem.session_cache import SessionCache, SessionCacheStore
from tandem.v1 import common_pb2
from tandem.wire import WIRE_VERSION

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheConfig:
    budget_mb: int = 4096  # KV bytes for all sessions; 0 = unbounded
    session_ttl_s: float = 3600.0  # idle sessions are dropped after this; 0 = never

    def __post_init__(self):
        if self.budget_mb < 0 or self.session_ttl_s < 0:
            raise ValueError("cache budget and TTL must be >= 0")


# A call that computes at most this many token rows (new tokens plus draft
# tokens, or the draft steps) is short: a few decode steps' time, which the
# event loop may wait for (ModelWorker.inline). Prefills are not.
INLINE_MAX_ROWS = 16
# A session counts as active on a service (ServiceStats.active_sessions) this
# long after its last call: a decoding session calls every round.
ACTIVE_S = 3.0


def inline_compute(mode: str, device: str, torch_compute: bool = True) -> bool:
    """Whether a model service runs its short calls inline (ModelWorker):
    "on", "off", or "auto": on for a CPU model on one torch thread, and for a
    service whose calls run no torch work (the n-gram drafter). Call it once
    the model is loaded (loading sets the threads).

    On two pinned cores, one a service, inlining cut the part of pipelined
    rounds' overhead spent in the services' handlers beyond their compute
    from 0.62-0.64 to 0.16-0.17 ms p50, and the overhead by 0.43-0.47 ms
    (bench/RESULTS.md). With more threads it stays off: OpenMP would then
    keep a second thread pool, the loop's, beside the worker's, and libgomp
    cuts the spin of every idle thread once they outnumber the cores."""
    if mode == "auto":
        return not torch_compute or (device == "cpu" and torch.get_num_threads() == 1)
    return mode == "on"


class InvalidRequest(ValueError):
    """Bad input: answered with INVALID_ARGUMENT."""


@dataclass(frozen=True)
class Fed:
    """What the chunks a call's prefill ran ahead of it did (ModelServiceBase.prefill_ahead)."""
    tokens: int = 0  # new tokens run into the cache ahead of the call
    cropped: int = 0  # tokens the first chunk's checkout cropped off the cache
    compute_ms: float = 0.0  # the chunks' time on the model worker
    scores: tuple = ()  # what a scoring run returned, chunk after chunk (the target's prompt_logprobs)

    def __add__(self, other: "Fed") -> "Fed":
        return Fed(self.tokens + other.tokens, self.cropped + other.cropped, self.compute_ms + other.compute_ms,
                   self.scores + other.scores)

    def onto(self, outcome, **more):
        """outcome (a VerifyOutcome or a Proposal) with the chunks' work added
        to its own, and `more` fields replaced."""
        if not self.tokens:
            return outcome
        return dataclasses.replace(outcome, prefilled=outcome.prefilled + self.tokens,
                                   cropped=outcome.cropped + self.cropped,
                                   compute_ms=outcome.compute_ms + self.compute_ms, **more)


def feed(store: SessionCacheStore, run: Callable[[SessionCache], object], session_id: str, prefix_len: int,
         prefix_fp: int, tokens: list[int]) -> Fed:
    """Runs `tokens` into the session's cache after the named prefix (one
    chunk of a long prefill; on the model worker): `run(cache)` puts the
    cache's unfed tokens through the model, and what it returns, if anything,
    are the chunk's scores. Raises CacheMiss as a call would."""
    start = time.perf_counter()
    cache, cropped = store.checkout(session_id, prefix_len, prefix_fp)
    cache.append(tokens)
    try:
        scores = run(cache)
    except Exception:
        store.release(session_id)  # a half-written cache is never reused
        raise
    cache.mark_fed()
    store.enforce_budget(keep=session_id)
    return Fed(len(tokens), cropped, (time.perf_counter() - start) * 1e3, tuple(scores or ()))


class ModelServiceBase:
    """Holds the store and worker; subclasses add Propose or Verify."""

    backend = "model"
    tree_width = 0  # ModelInfo.tree_width
    block_only = False  # ModelInfo.block_only
    feeds_ahead = True  # whether a long prefill runs in chunks (prefill_ahead), where prefill_chunk is set
    role = "model"  # "draft" or "target": names spans and labels metrics

    def __init__(self, info: LoadedModel | None, store: SessionCacheStore, worker: serving.ModelWorker,
                 prefill_chunk: int = 0):
        self.info = info
        self.store = store
        self.worker = worker  # the thread that built the model (ModelWorker.start_up) and runs it
        self.prefill_chunk = prefill_chunk  # ModelConfig.prefill_chunk (prefill_ahead); 0 = off
        # structured output's masks (tandem.grammar), against this model's tokenizer
        self.grammars = GrammarMasks(info.tokenizer if info is not None else None,
                                     info.vocab_size if info is not None else 0)
        log.info("%s: calls of up to %d token rows run %s", self.role, INLINE_MAX_ROWS,
                 "on the event loop when the model thread is idle" if worker.inline else "on the model thread")
        self.prefill_tokens = 0
        self.prefill_chunks = 0  # run ahead of their calls (prefill_ahead)
        self.calls = 0
        self._last_call: dict[str, float] = {}  # session id -> when its last call came (active_sessions)
        self.draining = asyncio.Event()  # set on SIGTERM: streams end once their calls are answered
        self._sweeper: asyncio.Task | None = None  # drops idle sessions while no call comes
        telemetry.watch_service(self)

    def _sweep_idle(self) -> None:
        """Started by the first call: every quarter of the TTL (at most a minute),
        drops the sessions idle past it, so that an idle service frees them too
        (a call does it on its way in)."""
        if self._sweeper is None and self.store.ttl_s:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        period = min(max(self.store.ttl_s / 4, 0.05), 60.0)
        while True:
            await asyncio.sleep(period)
            await self.worker.run(self.store.expire_idle)

    # --- checks ---------------------------------------------------------------
    def check_tokens(self, request_tokens, what: str, vocab_size: int) -> list[int]:
        tokens = list(request_tokens)
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"{what} has token ids outside [0, {vocab_size}): {bad[:5]}")
        return tokens

    def check_session(self, request) -> None:
        if not request.session_id:
            raise InvalidRequest("session_id is empty")
        if not request.new_tokens:
            raise InvalidRequest("new_tokens is empty: a call must bring at least the last committed token")

    def check_context(self, total: int) -> None:
        if self.info is not None and total > self.info.max_context:
            raise InvalidRequest(f"{total} tokens exceed the model's context window of {self.info.max_context}")

    def _call(self, request):
        """The request, checked, as the call the model worker runs; raises InvalidRequest."""
        raise NotImplementedError

    async def checked_call(self, context, request):
        """self._call(request), or the rpc ends with INVALID_ARGUMENT (or
        FAILED_PRECONDITION: a grammar, and no tokenizer to compile it against)."""
        if request.session_id:
            self._last_call[request.session_id] = time.monotonic()
        grammar = request.sampling.grammar
        if grammar and not self.grammars.compiled(grammar):
            try:  # off the event loop: the first grammar builds the tokenizer's tables (seconds)
                await asyncio.to_thread(self.grammars.check, grammar)
            except GrammarUnavailable as err:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
            except ValueError as err:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        try:
            return self._call(request)
        except InvalidRequest as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))

    async def run_checked(self, context, fn, *args, cancelled=None, rows: int | None = None, priority: int = 0):
        """Runs fn on the model worker and maps failures to status codes;
        `rows`: the token rows the call computes (inline if few); `priority`:
        the request's, its place in the worker's queue."""
        return await self._mapped(context, self.compute(fn, *args, cancelled=cancelled, rows=rows, priority=priority))

    def compute(self, fn, *args, cancelled=None, rows: int | None = None, priority: int = 0):
        """run_checked's work, unmapped: fn on the model worker (an awaitable)."""
        return self.worker.run(fn, *args, cancelled=cancelled, span=f"tandem.{self.role}.compute",
                               short=rows is not None and rows <= INLINE_MAX_ROWS, priority=priority)

    async def prefill_ahead(self, context, call, run: Callable[[SessionCache], object] | None,
                            priority: int | None = None, chunk: int | None = None):
        """Chunked prefill: a call that brings more than prefill_chunk new
        tokens (a prompt, a long new turn) has all but its last prefill_chunk
        or fewer run into its session's cache first, one chunk a worker call
        at the call's priority. The calls of other sessions that queue
        meanwhile go between two chunks, so that a long prompt holds up their
        rounds for one chunk's time, not the whole prompt's. Returns the call
        with those tokens moved into its prefix, and what the chunks did (Fed).

        Each chunk names the prefix it extends (invariant 2), so a session
        evicted between two chunks ends in a cache miss, which the orchestrator
        re-syncs. A call cancelled between two chunks leaves the cache holding
        a prefix of the committed tokens, which the next call extends or crops.
        `run` puts a cache's unfed tokens through the model (None: no chunks);
        `priority`: the chunks' place in the worker's queue (default the call's);
        `chunk`: the tokens a chunk (default prefill_chunk)."""
        chunk = self.prefill_chunk if chunk is None else chunk
        tokens = call.new_tokens
        if not chunk or run is None or len(tokens) <= chunk:
            return call, Fed()
        prefix_len = call.prefix_len
        prefix_fp = call.prefix_fp if prefix_len else fingerprint.EMPTY
        done = Fed()
        while len(tokens) > chunk:
            part, tokens = tokens[:chunk], tokens[chunk:]
            fed = await self._mapped(context, self.worker.run(
                feed, self.store, run, call.session_id, prefix_len, prefix_fp, part,
                span=f"tandem.{self.role}.prefill", priority=call.priority if priority is None else priority),
                count=False)
            self.prefill_chunks += 1
            done += fed
            prefix_len, prefix_fp = prefix_len + len(part), fingerprint.extend(prefix_fp, part)
        return dataclasses.replace(call, prefix_len=prefix_len, prefix_fp=prefix_fp, new_tokens=tokens), done

    async def run_batched(self, context, batcher, call, alone):
        """As run_checked, through a tandem.batcher.CallBatcher (--batch-verifies,
        --batch-drafts); alone(): the call's work run by itself (its compute)."""
        return await self._mapped(context, batcher.submit(call, alone))

    async def _mapped(self, context, work, count: bool = True):
        from tandem.session_cache import CacheMiss

        self.calls += count
        self._sweep_idle()
        try:
            return await work
        except CacheMiss as miss:
            await serving.abort_cache_miss(context, miss)
        except InvalidRequest as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))

    # --- shared rpcs -----------------------------------------------------------
    def model_info(self) -> common_pb2.ModelInfo:
        info = self.info
        return common_pb2.ModelInfo(
            model_id=info.model_id,
            tokenizer_fingerprint=info.tokenizer_fingerprint,
            vocab_size=info.vocab_size,
            max_context=info.max_context,
            dtype=self._param_attr("dtype", "none").removeprefix("torch."),
            device=self._param_attr("device", "cpu"),
            backend=self.backend,
            eos_token_ids=list(info.eos_token_ids),
            host_id=placement.host_id(),
            cpus=placement.cpus(),
            threads=torch.get_num_threads(),
            tree_width=self.tree_width,
            block_only=self.block_only,
            prefill_chunk=self.prefill_chunk if self.feeds_ahead else 0,
            wire_version=WIRE_VERSION,
        )

    def _param_attr(self, name: str, default: str) -> str:
        params = self.info.model.parameters() if self.info.model is not None else iter(())
        first = next(params, None)
        return str(getattr(first, name)) if first is not None else default

    async def GetModelInfo(self, request, context):
        return self.model_info()

    async def ReleaseSession(self, request, context):
        self._last_call.pop(request.session_id, None)
        released = await self.worker.run(self.store.release, request.session_id)
        return common_pb2.ReleaseSessionReply(released=released)

    async def ForkSession(self, request, context):
        if not request.session_id or not request.source_session_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session_id and source_session_id are required")
        if request.session_id == request.source_session_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a session cannot be forked into itself")
        if request.prefix.length < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prefix.length must be >= 1")
        forked = await self.worker.run(self.store.fork, request.source_session_id, request.session_id,
                                       request.prefix.length, request.prefix.fingerprint)
        return common_pb2.ForkSessionReply(forked=forked)

    def counts(self) -> dict[str, int]:
        """What GetStats reports, keyed by ServiceStats field; the metrics read it too."""
        counters = self.store.counters
        return dict(
            sessions=len(self.store),
            cache_bytes=self.store.total_bytes(),
            cache_budget_bytes=self.store.budget_bytes,
            evictions=counters.evictions,
            cache_misses=counters.misses,
            cache_hits=counters.hits,
            prefill_tokens=self.prefill_tokens,
            calls=self.calls,
            queue_depth=self.worker.queue_depth,
            active_sessions=self.active_sessions(),
            busy_ms=int(self.worker.busy_s * 1e3),
            forks=counters.forks,
            prefill_chunks=self.prefill_chunks,
            verify_batches=0,
            batched_verifies=0,
            draft_batches=0,
            batched_drafts=0,
        )

    def active_sessions(self) -> int:
        """Sessions whose last Propose or Verify came in the last ACTIVE_S
        seconds, from any orchestrator. (A call that runs longer, a long
        prefill, stops counting until the session's next one.)"""
        since = time.monotonic() - ACTIVE_S
        # list(): a plain dict copied in one C call, safe while the event loop
        # adds to it (the metrics read this from their own thread)
        for session_id, at in list(self._last_call.items()):
            if at < since:
                self._last_call.pop(session_id, None)
        return len(self._last_call)

    def _store_counts(self) -> dict[str, int]:
        return dict(sessions=len(self.store), cache_bytes=self.store.total_bytes(),
                    evictions=self.store.counters.evictions)

    async def GetStats(self, request, context):
        # The store's numbers in one snapshot on the model thread, after the calls
        # queued before this one: read apart, an idle sweep running between them
        # could report no session beside the bytes of the one it dropped.
        store = await self.worker.run(self._store_counts)
        return common_pb2.ServiceStats(**{**self.counts(), **store})
