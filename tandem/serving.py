"""What every Tandem gRPC server shares: construction with health checking and
reflection, a single model worker thread, status helpers and graceful drain."""
from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import itertools
import logging
import math
import queue
import signal
import threading
import time
import weakref
from typing import Callable, Iterable, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem import telemetry

log = logging.getLogger(__name__)

T = TypeVar("T")

# Large enough for dense draft distributions of a 152k vocabulary at k = 16.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# Clients ping a quiet connection every 20 s and give up on one whose peer does
# not answer in 10 s (a hung or stopped process, a dead node): a stream that
# waits on it fails with UNAVAILABLE instead of waiting forever (a `tandem
# generate` whose orchestrator was stopped with SIGSTOP ended after 60 s).
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
# Servers accept those pings, also during a long quiet call (a prefill), and a
# port another process serves on is refused (gRPC sets SO_REUSEPORT otherwise,
# and two servers on one port would split the calls between them).
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
]
CACHE_MISS_KEY = "tandem-cache-miss"


def create_server(
    address: str, register: Iterable[Callable[[grpc.aio.Server], str]], credentials=None, local_socket: str = ""
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Builds (does not start) a server on `address` ("host:0" picks a free port).

    `register` are functions that add a servicer and return its full service name.
    `credentials`: grpc.ServerCredentials to serve TLS with (tandem.tls);
    `local_socket`: a Unix socket path it also serves on, without TLS (the
    in-process HTTP gateway's way in).
    Returns the server, the bound port and its health servicer."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    names = [add(server) for add in register]
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:
        port = server.add_secure_port(address, credentials) if credentials is not None \
            else server.add_insecure_port(address)
        if local_socket:
            server.add_insecure_port(f"unix:{local_socket}")
    except RuntimeError:  # grpc's words: "Failed to bind to address"
        port = 0
    if port == 0:
        raise OSError(f"could not bind {address}: is another process serving on it?")
    return server, port, health_servicer


def freeze_startup_objects() -> None:
    """Moves every object alive after start-up (the model's modules and
    parameters, transformers, the tokenizer, grpc) out of the garbage
    collector's reach, as vLLM does. Without it a full collection walks them
    all: on a 2-core VM such collections took 100-390 ms in the middle of
    serving, in each of the three processes, and a draft or verify call that
    met one waited for it."""
    gc.collect()
    gc.freeze()


async def set_serving(health_servicer, names: Iterable[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *names]:
        await health_servicer.set(name, status)


def stop_on_signals() -> asyncio.Event:
    """An event that SIGTERM or SIGINT sets, from now on (a service installs
    it before it says it is ready, so that a signal right after is a drain)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def run_until_signalled(server: grpc.aio.Server, health_servicer, names: list[str], grace_s: float = 10.0,
                              draining: asyncio.Event | None = None, stop: asyncio.Event | None = None):
    """Serves until SIGTERM or SIGINT (`stop`, from stop_on_signals), then
    drains: NOT_SERVING, set `draining` (long-lived streams end once their
    calls are answered), finish in-flight calls, stop."""
    stop = stop or stop_on_signals()
    await stop.wait()
    log.info("draining (grace %.0fs)", grace_s)
    await set_serving(health_servicer, names, False)
    if draining is not None:
        draining.set()
    await server.stop(grace_s)


# Each channel makes its own connections. gRPC otherwise shares them among a
# process's channels to one address, and a new channel to a server that came
# back on the address of one that stopped took over the old connection's
# reconnect back-off: its first call failed at once with UNAVAILABLE
# ("Connection refused"), with the new server listening (a flaky test, where
# ports come round again within a process).
OWN_CONNECTIONS = [("grpc.use_local_subchannel_pool", 1)]

# The orchestrator's channels to its model services: a service that comes back
# is reconnected within 5 s (gRPC's default backoff grows to 120 s, and calls
# fail at once while it waits).
SERVICE_CHANNEL_OPTIONS = [*CHANNEL_OPTIONS, *KEEPALIVE_OPTIONS, *OWN_CONNECTIONS,
                           ("grpc.max_reconnect_backoff_ms", 5000)]


def insecure_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=SERVICE_CHANNEL_OPTIONS)


def service_channel(address: str, credentials=None, server_name: str = "") -> grpc.aio.Channel:
    """A channel to a model service: over TLS with `credentials`
    (tandem.tls.channel_credentials), checking that the certificate holds
    `server_name` where given (else the address's host); else plaintext."""
    if credentials is None:
        return insecure_channel(address)
    options = [*SERVICE_CHANNEL_OPTIONS, *([("grpc.ssl_target_name_override", server_name)] if server_name else [])]
    return grpc.aio.secure_channel(address, credentials, options=options)


class ModelWorker:
    """One thread that owns the model: calls run one at a time, the lowest
    `priority` first and, among equals, in arrival order (vLLM's priority
    scheduling: a request's priority rides on each of its calls; all 0, the
    order is arrival's). A call that has started runs to its end: a later,
    more urgent one waits for it, never pre-empts it.

    A cancelled call that has not started never runs; one that has started sees
    its `cancelled` event set and may stop early (between draft steps).

    The model is built on this thread too (start_up), so that one thread of the
    process runs OpenMP parallel regions. libgomp gives each such thread a pool
    of its own, and once its threads outnumber the cores it cuts every idle
    thread's spin to almost nothing: a model loaded on the main thread and run
    here made two torch threads spin-wait as if OMP_WAIT_POLICY were PASSIVE
    (tandem.cli has the figures).

    With `inline` set (tandem.model_service.inline_compute), a short call
    that finds the worker idle runs on the calling thread, the server's event
    loop, instead: it skips the hop to the worker thread and the wake-up of
    the loop after it. The loop waits meanwhile, which a short call allows."""

    def __init__(self, name: str, inline: bool = False):
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._arrivals = itertools.count()  # ties in priority go in arrival order
        self._closed = False
        # The thread holds the queue, not the worker: a worker no longer used is
        # collected, and its thread then ends (as a ThreadPoolExecutor's does).
        self._busy = [0.0]  # seconds spent running calls, on the thread or inline; the thread adds to it
        self._thread = threading.Thread(target=_serve, args=(self._queue, self._busy), name=f"{name}_0",
                                        daemon=True)
        self._thread.start()
        weakref.finalize(self, self._queue.put, (math.inf, -1, None))
        self.inline = inline
        self.queue_depth = 0
        self._depth_lock = threading.Lock()  # the loop adds a call, the thread that ends it takes it off
        self.inline_calls = 0

    def submit(self, fn: Callable[..., T], *args, priority: int = 0) -> concurrent.futures.Future:
        """fn(*args) queued for the worker thread, by priority then arrival;
        RuntimeError once the worker is shut down."""
        if self._closed:
            raise RuntimeError("the model worker is shut down")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((priority, next(self._arrivals), (future, fn, args)))
        return future

    def start_up(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the worker thread, waited for: loading the model before serving."""
        return self.submit(fn, *args).result()

    async def run(self, fn: Callable[..., T], *args, cancelled: threading.Event | None = None,
                  span: str | None = None, short: bool = False, priority: int = 0) -> T:
        """Runs fn(*args) on the worker thread, or inline if it is `short` and
        the worker idle (see the class); `span` names a span for it under the
        current one while tracing; `priority`: its place in the queue (lower
        first)."""
        if span is not None:
            fn = telemetry.in_span(span, fn)
        if short and self.inline and self.queue_depth == 0:
            # Nothing is queued or running on the thread (queue_depth drops only
            # once a call has returned), and nothing else runs on the loop meanwhile.
            self.inline_calls += 1
            started = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self._busy[0] += time.perf_counter() - started
        job = self.submit(fn, *args, priority=priority)
        # A call counts in queue_depth until its function has run, or was
        # cancelled before it started: a cancelled call that is running still
        # holds the worker. It is taken off where the call ends (the worker's
        # thread), not on the loop: a loop stopped by then would leave it counted.
        with self._depth_lock:
            self.queue_depth += 1
        job.add_done_callback(self._left)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            if cancelled is not None:
                cancelled.set()
            raise

    @property
    def busy_s(self) -> float:
        """Seconds spent running calls so far, on the thread or inline."""
        return self._busy[0]

    def _left(self, _job=None) -> None:
        with self._depth_lock:
            self.queue_depth -= 1

    def shutdown(self) -> None:
        """Cancels the calls that have not started; the thread ends after the running one."""
        self._closed = True
        while True:
            try:
                _, _, job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        self._queue.put((math.inf, next(self._arrivals), None))


def _serve(jobs: queue.PriorityQueue, busy: list[float]) -> None:
    """A ModelWorker's thread: runs its jobs until shutdown (a job None),
    adding the seconds each ran to busy[0]. A job's references are dropped
    once it has run, so that what it held (a service, its caches) is not kept
    alive by a thread that waits."""
    while True:
        _, _, job = jobs.get()
        if job is None:
            return
        future, fn, args = job
        del job
        if future.set_running_or_notify_cancel():  # else cancelled before it started
            started = time.perf_counter()
            try:
                result = fn(*args)
            except BaseException as err:  # noqa: BLE001 (the caller gets it)
                busy[0] += time.perf_counter() - started
                future.set_exception(err)
            else:
                busy[0] += time.perf_counter() - started
                future.set_result(result)
                del result
        del future, fn, args


async def abort_cache_miss(context: grpc.aio.ServicerContext, miss: Exception):
    context.set_trailing_metadata(((CACHE_MISS_KEY, "1"),))
    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(miss))


def marks_cache_miss(trailing_metadata) -> bool:
    return any(key == CACHE_MISS_KEY for key, _ in (trailing_metadata or ()))


def is_cache_miss(err: grpc.aio.AioRpcError) -> bool:
    return err.code() == grpc.StatusCode.FAILED_PRECONDITION and marks_cache_miss(err.trailing_metadata())
