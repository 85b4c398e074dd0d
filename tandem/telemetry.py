"""Traces and metrics (DESIGN §6): one setup per process, spans that cost next
to nothing while tracing is off, W3C trace context in gRPC metadata, and
OpenTelemetry instruments exported to Prometheus.

Instrumented code asks this module for the tracer and the instruments at call
time and never keeps them: install() swaps both, so tests run their own
providers in one process without OpenTelemetry's set-once globals.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Callable

from opentelemetry import propagate, trace
from opentelemetry.metrics import CallbackOptions, NoOpMeterProvider, Observation
from opentelemetry.trace import SpanKind, Status, StatusCode

log = logging.getLogger(__name__)

SERVICE_NAMES = {"orchestrator": "tandem-orchestrator", "draft": "tandem-draft", "target": "tandem-target"}
TRACE_EXPORTERS = ("none", "console", "otlp")
NO_SPAN = trace.INVALID_SPAN  # what every span function returns while tracing is off
_NULL_SCOPE = contextlib.nullcontext(NO_SPAN)

SECONDS_BUCKETS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0]
TOKENS_BUCKETS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 24, 33, 65]


@dataclass(frozen=True)
class TelemetryConfig:
    service_name: str
    traces: str = "none"  # none, console (stderr) or otlp (OTLP/HTTP, OTEL_EXPORTER_OTLP_* env)
    metrics_port: int = 0  # a Prometheus /metrics server on this port; 0 = none
    metrics_host: str = "127.0.0.1"
    http_metrics: bool = False  # metrics on without that server: the HTTP API's /metrics alone serves them

    @property
    def metrics(self) -> bool:
        return bool(self.metrics_port) or self.http_metrics

    def __post_init__(self):
        if self.traces not in TRACE_EXPORTERS:
            raise ValueError(f"traces must be one of {TRACE_EXPORTERS}, got {self.traces!r}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")


_SERVICE_COUNTERS = [
    ("tandem.session_cache.hits", "cache_hits", "{call}", "calls whose named prefix was in the session cache"),
    ("tandem.session_cache.misses", "cache_misses", "{call}", "calls answered with a cache miss"),
    ("tandem.session_cache.evictions", "evictions", "{session}", "sessions evicted for the budget or the TTL"),
    ("tandem.service.prefill_tokens", "prefill_tokens", "{token}", "tokens prefilled: prompts, new turns, re-syncs"),
    ("tandem.service.calls", "calls", "{call}", "Propose or Verify calls run on the model worker"),
    ("tandem.worker.busy", "busy_ms", "ms", "time the model worker spent running calls (its busy share, as a rate)"),
    ("tandem.session_cache.forks", "forks", "{session}", "sessions made by copying a prefix of another (ForkSession)"),
    ("tandem.service.prefill_chunks", "prefill_chunks", "{chunk}",
     "chunks of long prefills run ahead of their calls, other calls between them (--prefill-chunk)"),
    ("tandem.verify.batches", "verify_batches", "{forward}",
     "target forwards that verified queued calls together (--batch-verifies)"),
    ("tandem.verify.batched", "batched_verifies", "{call}", "verify calls those forwards held"),
    ("tandem.draft.batches", "draft_batches", "{batch}",
     "draft batches that drafted queued calls' blocks in lockstep (--batch-drafts)"),
    ("tandem.draft.batched", "batched_drafts", "{call}", "propose calls those batches held"),
]
_SERVICE_GAUGES = [
    ("tandem.session_cache.sessions", "sessions", "{session}", "sessions held"),
    ("tandem.session_cache.size", "cache_bytes", "By", "bytes of KV cache held"),
    ("tandem.worker.queue_depth", "queue_depth", "{call}", "calls waiting for or running on the model worker"),
    ("tandem.sessions.active", "active_sessions", "{session}",
     "sessions that called in the last 3 s, from any orchestrator"),
]
# The model services of this process: each has a role ("draft", "target") and
# counts(), its GetStats numbers keyed like common.proto's ServiceStats.
_services: "weakref.WeakSet" = weakref.WeakSet()


def watch_service(service) -> None:
    """Reports service.counts() in the metrics, labelled with service.role, while it lives."""
    _services.add(service)


# The orchestrator's clients of replicated model services (orchestrator.replicas.Replicas).
_replica_sets: "weakref.WeakSet" = weakref.WeakSet()


def watch_replicas(replicas) -> None:
    """Reports each replica's sessions (replicas.loads()) in the metrics, while `replicas` lives."""
    _replica_sets.add(replicas)


def _observe_replicas(index: int):
    def callback(options: CallbackOptions):
        return [Observation(counts[index], {"service": replicas.role, "replica": address})
                for replicas in list(_replica_sets) for address, counts in replicas.loads().items()]

    return callback


def _observe(key: str):
    def callback(options: CallbackOptions):
        totals: dict[str, int] = {}
        for service in list(_services):
            totals[service.role] = totals.get(service.role, 0) + service.counts()[key]
        return [Observation(value, {"role": role}) for role, value in totals.items()]

    return callback


class Instruments:
    """The metric instruments, made from one meter; no-ops when `meter` is None."""

    def __init__(self, meter=None):
        self.enabled = meter is not None
        meter = meter or NoOpMeterProvider().get_meter("tandem")
        counter, histogram = meter.create_counter, meter.create_histogram
        # orchestrator: counters first (DESIGN §6), fed once per request from its RoundStats
        self.requests = counter("tandem.requests", "{request}", "requests finished, by finish_reason")
        self.rejected_requests = counter("tandem.requests.rejected", "{request}",
                                         "requests refused with RESOURCE_EXHAUSTED, by limit: server "
                                         "(--max-concurrent-requests) or tenant (its quotas)")
        self.completion_tokens = counter("tandem.completion_tokens", "{token}", "tokens streamed to clients")
        self.prompt_tokens = counter("tandem.prompt_tokens", "{token}", "tokens of prompts and new chat turns")
        self.cached_prompt_tokens = counter("tandem.prompt_tokens.cached", "{token}", (
            "prompt tokens whose caches a parked session held, so no service prefilled them (--prefix-cache)"))
        self.drafts = counter("tandem.drafts", "{draft}", "draft blocks verified (rounds)")
        self.draft_tokens = counter("tandem.draft_tokens", "{token}", "draft tokens verified")
        self.accepted_tokens = counter("tandem.accepted_tokens", "{token}", "draft tokens the target accepted")
        self.accepted_per_position = counter("tandem.accepted_tokens_per_position", "{token}",
                                             "accepted draft tokens by position in the block (0-based)")
        self.predraft_attempts = counter("tandem.predraft.attempts", "{draft}", "pre-drafts launched beside a verify")
        self.predraft_hits = counter("tandem.predraft.hits", "{draft}", "pre-drafted blocks used by the next round")
        self.undrafted_rounds = counter("tandem.rounds.undrafted", "{round}",
                                        "rounds decoded on the target alone: the draft service was unavailable")
        self.replica_failovers = counter("tandem.replica.failovers", "{call}", (
            "model calls a replica did not answer, whose sessions went to another replica, by service "
            "(orchestrator.replicas)"))
        self.alternative_rounds = counter("tandem.rounds.alternative", "{round}",
                                          "rounds that took an alternative verified beside their block (--tree-width)")
        self.draft_distribution_bytes = counter("tandem.draft_distribution_bytes", "By", (
            "bytes of draft distributions forwarded to the target under sampling (serialized; none under greedy)"))
        # orchestrator: per-round and per-request distributions
        self.tokens_per_round = histogram("tandem.tokens_per_round", "{token}", "tokens committed by a round",
                                          explicit_bucket_boundaries_advisory=TOKENS_BUCKETS)
        seconds = dict(unit="s", explicit_bucket_boundaries_advisory=SECONDS_BUCKETS)
        self.time_to_first_token = histogram("tandem.time_to_first_token", description=(
            "request start to its first streamed token"), **seconds)
        self.inter_token_latency = histogram("tandem.inter_token_latency", description=(
            "time between streamed chunks divided by the tokens in the later chunk"), **seconds)
        self.round_overhead = histogram("tandem.round.overhead", description=(
            "orchestrator overhead of a round: wall time less the services' compute on the critical path"), **seconds)
        # the HTTP API (orchestrator/http_gateway.py): each request, by route and status
        self.http_requests = counter("tandem.http.requests", "{request}",
                                     "HTTP API requests answered, by method, route and status code")
        self.http_duration = histogram("tandem.http.duration", description=(
            "HTTP API request start to its answer's end (a stream's last event), by method and route"), **seconds)
        # model services: compute per call, recorded where it is measured
        self.verify_compute = histogram("tandem.verify.compute", description=(
            "target compute of a verify that prefilled at most one token"), **seconds)
        self.draft_step = histogram("tandem.draft.step", description="draft compute per drafted token", **seconds)
        # orchestrator: its sessions on each model replica, and all orchestrators' (watch_replicas)
        meter.create_observable_gauge("tandem.replica.sessions", [_observe_replicas(0)], "{session}", (
            "this orchestrator's sessions on each model replica: a call in flight, or placed and about to call"))
        meter.create_observable_gauge("tandem.replica.load", [_observe_replicas(1)], "{session}", (
            "every orchestrator's sessions on each model replica, as new sessions are placed by them "
            "(--replica-load-interval)"))
        # model services: read from the counts they keep for GetStats (see watch_service)
        for name, key, unit, description in _SERVICE_COUNTERS:
            meter.create_observable_counter(name, [_observe(key)], unit, description)
        for name, key, unit, description in _SERVICE_GAUGES:
            meter.create_observable_gauge(name, [_observe(key)], unit, description)


_tracer: trace.Tracer | None = None
_instruments = Instruments()
_exposed = None  # the meter provider whose Prometheus reader setup() started, until its shutdown


def install(tracer_provider=None, meter_provider=None) -> None:
    """Routes spans and metrics to these providers; None turns either off."""
    global _tracer, _instruments
    _tracer = tracer_provider.get_tracer("tandem") if tracer_provider is not None else None
    _instruments = Instruments(meter_provider.get_meter("tandem") if meter_provider is not None else None)


def instruments() -> Instruments:
    return _instruments


def prometheus_exposition(accept: str = "") -> tuple[bytes, str] | None:
    """What the metrics server serves, as (body, content type) in the format an
    HTTP Accept header asks for (Prometheus' text, or OpenMetrics); None while
    setup() exports no metrics."""
    if _exposed is None:
        return None
    from prometheus_client import REGISTRY
    from prometheus_client.exposition import choose_encoder

    encode, content_type = choose_encoder(accept)
    return encode(REGISTRY), content_type


def tracing() -> bool:
    return _tracer is not None


# --- spans ------------------------------------------------------------------
def start_span(name: str, parent=None, kind: SpanKind = SpanKind.INTERNAL, attributes=None) -> trace.Span:
    """A span that is not made current (safe across yields); the caller ends it.
    `parent` is a span or a Context; NO_SPAN while tracing is off."""
    if _tracer is None:
        return NO_SPAN
    context = trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent
    return _tracer.start_span(name, context, kind, attributes)


def child_span(name: str, parent: trace.Span, kind: SpanKind = SpanKind.INTERNAL):
    """A context manager: a span under `parent`, current inside the block (so
    outgoing calls carry it), which records an exception that escapes."""
    if _tracer is None:
        return _NULL_SCOPE
    return _tracer.start_as_current_span(name, trace.set_span_in_context(parent), kind)


def server_span(name: str, grpc_context):
    """child_span for an rpc handler, continuing the caller's trace from the
    W3C headers in the call's metadata."""
    if _tracer is None:
        return _NULL_SCOPE
    carrier = dict(grpc_context.invocation_metadata() or ())
    return _tracer.start_as_current_span(name, propagate.extract(carrier), SpanKind.SERVER)


def request_span(name: str, grpc_context, attributes=None):
    """server_span that is never current, for a streaming handler: a span kept
    current across its yields could be detached in another context."""
    if _tracer is None:
        return _NULL_SCOPE
    parent = propagate.extract(dict(grpc_context.invocation_metadata() or ()))
    return _ending(_tracer.start_span(name, parent, SpanKind.SERVER, attributes))


@contextlib.contextmanager
def _ending(span: trace.Span):
    try:
        yield span
    except Exception as err:
        span.record_exception(err)
        span.set_status(Status(StatusCode.ERROR, f"{type(err).__name__}: {err}"))
        raise
    except BaseException:  # the client went away
        span.set_attribute("tandem.cancelled", True)
        raise
    finally:
        span.end()


def outgoing_metadata() -> tuple[tuple[str, str], ...] | None:
    """W3C trace context of the current span as gRPC metadata; None when there is none."""
    if _tracer is None:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items()) or None


def in_span(name: str, fn: Callable) -> Callable:
    """fn, run in a span under the current one, for another thread (the model
    worker) where the caller's context is not current; fn itself when not tracing."""
    if _tracer is None:
        return fn
    current = trace.get_current_span()
    if not current.get_span_context().is_valid:
        return fn
    tracer, parent, queued = _tracer, trace.set_span_in_context(current), time.perf_counter()

    def run(*args):
        with tracer.start_as_current_span(name, parent) as span:
            span.set_attribute("tandem.queued_ms", (time.perf_counter() - queued) * 1e3)
            return fn(*args)

    return run


# --- process setup ---------------------------------------------------------
class Telemetry:
    """What setup() started; shutdown() flushes spans and stops /metrics."""

    def __init__(self, tracer_provider=None, meter_provider=None, http_server=None):
        self.tracer_provider, self.meter_provider, self.http_server = tracer_provider, meter_provider, http_server

    def shutdown(self) -> None:
        global _exposed
        install()
        if _exposed is self.meter_provider:
            _exposed = None
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()  # unregisters the Prometheus collector
        if self.http_server is not None:
            self.http_server.shutdown()
            self.http_server.server_close()


def setup(config: TelemetryConfig, set_global: bool = True) -> Telemetry:
    """Exports spans and serves Prometheus metrics as configured, and installs
    the providers here (and as OpenTelemetry's globals when set_global)."""
    global _exposed
    from opentelemetry.sdk.resources import Resource

    resource = Resource.create({"service.name": config.service_name})
    tracer_provider = meter_provider = http_server = None
    if config.traces != "none":
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

        if config.traces == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()  # endpoint from OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else localhost:4318
        else:
            exporter = ConsoleSpanExporter(out=sys.stderr)
        tracer_provider = TracerProvider(resource=resource)  # sampler from OTEL_TRACES_SAMPLER, else parent-based on
        tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
    if config.metrics:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
        from prometheus_client import start_http_server

        if config.metrics_port:
            http_server, _ = start_http_server(config.metrics_port, config.metrics_host)
            log.info("Prometheus metrics on http://%s:%d/metrics", config.metrics_host, config.metrics_port)
        if config.http_metrics:
            log.info("Prometheus metrics on the HTTP API's /metrics")
        # Exemplars are not exported to Prometheus, and filtering them off halves a recording's cost.
        meter_provider = MeterProvider([PrometheusMetricReader()], resource=resource,
                                       exemplar_filter=AlwaysOffExemplarFilter())
        _exposed = meter_provider
    if set_global:
        if tracer_provider is not None:
            trace.set_tracer_provider(tracer_provider)
        if meter_provider is not None:
            from opentelemetry import metrics

            metrics.set_meter_provider(meter_provider)
    install(tracer_provider, meter_provider)
    return Telemetry(tracer_provider, meter_provider, http_server)
