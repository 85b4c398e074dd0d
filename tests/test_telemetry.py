"""Traces and metrics over the real cluster: W3C context crosses the real gRPC
hops, the counters equal the Completion's stats, and --metrics-port serves them."""
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tandem import telemetry
from tandem.launch import free_port
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

PROMPT = [5, 17, 99, 3, 42]
REQUEST = "tandem.v1.Tandem/Generate"
CLIENT_SPANS = {"tandem.draft", "tandem.predraft", "tandem.verify"}
SERVER_SPANS = {"tandem.v1.DraftService/Propose", "tandem.v1.TargetService/Verify"}
TRACE_ID, PARENT_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7
TRACEPARENT = ("traceparent", f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01")


@pytest.fixture
def recorded():
    """Spans and metrics of this test, in memory; off again afterwards."""
    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    telemetry.install(tracer_provider, MeterProvider([reader]))
    yield spans, reader
    telemetry.install()


def _generate(cluster, pipeline=True):
    with cluster.client() as client:
        return client.generate(prompt_ids=PROMPT, max_tokens=12, num_draft_tokens=3, pipeline=pipeline)


def _wait_for(spans, name, count, timeout_s=10.0):
    """The finished spans, once `count` named `name` are among them (services end theirs asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        finished = spans.get_finished_spans()
        if sum(s.name == name for s in finished) >= count or time.monotonic() > deadline:
            return finished
        time.sleep(0.05)


def test_one_trace_spans_the_request_its_rounds_and_both_services(same_cluster, recorded):
    spans, _ = recorded
    # Sequential, so that every kind of call is made: the draft's prefill beside the
    # target's (a pre-draft span), then a fresh draft each round. (Pipelined with
    # draft = target, every pre-draft hits and no fresh draft is needed.)
    stats = _generate(same_cluster, pipeline=False).stats
    finished = _wait_for(spans, "tandem.v1.TargetService/Verify", stats.rounds)
    by_id = {s.context.span_id: s for s in finished}
    (request,) = [s for s in finished if s.name == REQUEST]
    trace_id = request.context.trace_id
    assert request.attributes["tandem.rounds"] == stats.rounds
    assert request.attributes["tandem.accepted"] == stats.accepted_tokens

    rounds = [s for s in finished if s.name == "tandem.round"]
    assert all(s.parent.span_id == request.context.span_id for s in rounds)
    done = [s for s in rounds if "tandem.accepted" in s.attributes]  # the last one was cut short by the stop
    assert len(done) == stats.rounds
    assert sum(s.attributes["tandem.accepted"] for s in done) == stats.accepted_tokens
    assert sum(s.attributes["tandem.predraft_hit"] for s in rounds) == stats.predraft_hits

    calls = [s for s in finished if s.name in CLIENT_SPANS]
    assert {s.name for s in calls} == CLIENT_SPANS
    assert all(by_id[s.parent.span_id].name == "tandem.round" for s in calls)

    def ancestors(span):
        while span.parent is not None and span.parent.span_id in by_id:
            span = by_id[span.parent.span_id]
            yield span

    served = [s for s in finished if s.name in SERVER_SPANS]
    assert {s.name for s in served} == SERVER_SPANS
    for span in served:  # their parents arrived in the gRPC metadata, not in-process
        assert span.context.trace_id == trace_id
        assert span.parent.is_remote and by_id[span.parent.span_id].name in CLIENT_SPANS
        assert request in ancestors(span)
    compute = [s for s in finished if s.name in ("tandem.draft.compute", "tandem.target.compute")]
    assert compute and all(by_id[s.parent.span_id].name in SERVER_SPANS for s in compute)
    assert all(s.context.trace_id == trace_id for s in finished)


def test_services_continue_the_callers_trace(same_cluster, recorded):
    spans, _ = recorded
    with grpc.insecure_channel(same_cluster.draft_address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        stub.Propose(draft_pb2.ProposeRequest(
            session_id="traced", prefix=common_pb2.PrefixRef(length=0), new_tokens=PROMPT, num_tokens=2,
        ), metadata=[TRACEPARENT])
        stub.ReleaseSession(common_pb2.ReleaseSessionRequest(session_id="traced"))
    finished = _wait_for(spans, "tandem.draft.compute", 1)
    (server,) = [s for s in finished if s.name == "tandem.v1.DraftService/Propose"]
    assert (server.context.trace_id, server.parent.span_id) == (TRACE_ID, PARENT_ID)
    assert server.attributes["tandem.drafted"] == 2
    (compute,) = [s for s in finished if s.name == "tandem.draft.compute"]
    assert compute.parent.span_id == server.context.span_id


def _points(reader) -> dict:
    """metric name -> {frozenset(attributes): data point}"""
    out = {}
    for resource_metrics in reader.get_metrics_data().resource_metrics:
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                out[metric.name] = {frozenset(p.attributes.items()): p for p in metric.data.data_points}
    return out


def test_counters_equal_the_completion_stats(same_cluster, recorded):
    _, reader = recorded
    result = _generate(same_cluster)
    stats = result.stats
    # The last round's pre-draft is cancelled when the request ends. Its call may
    # reach the draft's worker after the reply, and then leaves it at its next
    # layer: the worker's own count can read 0 before that call has come in. So
    # the gauges, read through GetStats, are collected until both read 0; a call
    # left on a worker keeps one above 0 and fails the test below.
    deadline = time.monotonic() + 10
    while True:
        points = _points(reader)
        depths = [points["tandem.worker.queue_depth"][frozenset({"role": role}.items())].value
                  for role in ("draft", "target")]
        if depths == [0, 0] or time.monotonic() > deadline:
            break
        time.sleep(0.05)

    def value(name, **attributes):
        return points[name][frozenset(attributes.items())].value

    assert value("tandem.drafts") == stats.rounds
    assert value("tandem.draft_tokens") == stats.drafted_tokens > 0
    assert value("tandem.accepted_tokens") == stats.accepted_tokens > 0
    assert [value("tandem.accepted_tokens_per_position", position=i)
            for i in range(len(stats.accepted_per_position))] == list(stats.accepted_per_position)
    assert value("tandem.predraft.attempts") == stats.predraft_attempts
    assert value("tandem.predraft.hits") == stats.predraft_hits
    assert value("tandem.rounds.undrafted") == stats.undrafted_rounds == 0
    assert value("tandem.rounds.alternative") == stats.alternative_hits
    assert value("tandem.requests", finish_reason="length") == 1
    assert value("tandem.completion_tokens") == len(result.token_ids) == 12
    per_round = points["tandem.tokens_per_round"][frozenset()]
    assert (per_round.count, per_round.sum) == (stats.rounds,
                                                stats.accepted_tokens + stats.rounds + stats.alternative_hits)
    assert points["tandem.time_to_first_token"][frozenset()].count == 1
    assert 0 < points["tandem.time_to_first_token"][frozenset()].sum * 1e3 <= stats.total_ms
    # A round's overhead is taken when the next verify goes out. Draft = target:
    # every round but the last sends a pre-drafted block at once; after the last, nothing goes out.
    assert points["tandem.round.overhead"][frozenset()].count == stats.rounds - 1
    assert points["tandem.verify.compute"][frozenset()].count >= 1
    assert points["tandem.draft.step"][frozenset()].count >= 1
    # the services' own GetStats counts, read at collection time
    for role in ("draft", "target"):
        assert value("tandem.session_cache.hits", role=role) >= stats.rounds
        assert value("tandem.worker.queue_depth", role=role) == 0
        assert ("tandem.session_cache.evictions" in points and "tandem.session_cache.size" in points)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def test_metrics_port_serves_prometheus_text(same_cluster):
    port = free_port()
    handle = telemetry.setup(telemetry.TelemetryConfig("tandem-orchestrator", metrics_port=port), set_global=False)
    try:
        stats = _generate(same_cluster).stats
        text = _scrape(port)
    finally:
        handle.shutdown()
    for name in ("tandem_drafts_total", "tandem_draft_tokens_total", "tandem_accepted_tokens_per_position_total",
                 "tandem_tokens_per_round_bucket", "tandem_time_to_first_token_seconds_bucket",
                 "tandem_inter_token_latency_seconds_bucket", "tandem_verify_compute_seconds_bucket",
                 "tandem_draft_step_seconds_bucket", "tandem_round_overhead_seconds_bucket",
                 "tandem_session_cache_hits_total", "tandem_session_cache_misses_total",
                 "tandem_session_cache_evictions_total", "tandem_worker_queue_depth", "tandem_sessions_active", "tandem_worker_busy_",
                 "tandem_session_cache_forks_total", "tandem_verify_batches_total", "tandem_verify_batched_total",
                 "tandem_service_prefill_chunks_total", "tandem_draft_distribution_bytes_total",
                 'service_name="tandem-orchestrator"'):
        assert name in text
    (accepted,) = [line for line in text.splitlines() if line.startswith("tandem_accepted_tokens_total{")]
    assert float(accepted.rsplit(" ", 1)[1]) == stats.accepted_tokens


def test_tracing_off_costs_no_span_and_no_metadata():
    assert not telemetry.tracing()
    assert telemetry.outgoing_metadata() is None
    assert telemetry.start_span("x") is telemetry.NO_SPAN
    with telemetry.child_span("x", telemetry.NO_SPAN) as span:
        assert span is telemetry.NO_SPAN
    assert not telemetry.instruments().enabled


def test_serve_flags_export_spans_and_serve_metrics(tiny_models):
    """tandem serve target --metrics-port P --otel-traces console, as a process."""
    metrics_port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    process = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", "target", "--model", tiny_models["target"], "--port", "0",
         "--dtype", "float32", "--threads", "1", "--metrics-port", str(metrics_port), "--otel-traces", "console"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        assert select.select([process.stdout], [], [], 120)[0], "the target service did not start in 120 s"
        ready = process.stdout.readline()
        assert ready.startswith("READY target"), process.stderr.read()
        address = ready.split()[-1]
        with grpc.insecure_channel(address) as channel:
            target_pb2_grpc.TargetServiceStub(channel).Verify(target_pb2.VerifyRequest(
                session_id="s", prefix=common_pb2.PrefixRef(length=0), new_tokens=PROMPT, draft_tokens=[1, 2],
            ), metadata=[TRACEPARENT], timeout=60)
        text = _scrape(metrics_port)
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    assert 'service_name="tandem-target"' in text
    (calls,) = [line for line in text.splitlines() if line.startswith("tandem_service_calls_total{")]
    assert 'role="target"' in calls and calls.endswith(" 1.0")
    # the console exporter flushed at shutdown: the call's spans, in the caller's trace
    assert '"name": "tandem.v1.TargetService/Verify"' in stderr and '"name": "tandem.target.compute"' in stderr
    assert f'"trace_id": "0x{TRACE_ID:032x}"' in stderr and f'"parent_id": "0x{PARENT_ID:016x}"' in stderr


def test_queue_depth_counts_a_cancelled_call_until_the_worker_is_free():
    import asyncio
    import threading
    import time

    from tandem.serving import ModelWorker

    async def scenario():
        worker = ModelWorker("depth")
        release = threading.Event()
        running = asyncio.create_task(worker.run(release.wait, 5))
        queued = asyncio.create_task(worker.run(time.sleep, 0))
        await asyncio.sleep(0.05)
        assert worker.queue_depth == 2
        running.cancel()  # started: the worker stays busy until its function returns
        queued.cancel()  # not started: it never runs
        await asyncio.sleep(0.05)
        assert worker.queue_depth == 1
        release.set()
        for _ in range(50):
            await asyncio.sleep(0.01)
            if worker.queue_depth == 0:
                break
        assert worker.queue_depth == 0
        worker.shutdown()

    asyncio.run(scenario())


def test_queue_depth_drops_when_a_call_ends_after_its_event_loop_has_closed():
    """A cluster stopped while a call ran (a pre-draft left on the worker) must
    not count that call for the rest of the process: the gauge sums every live
    service, so one stuck at 1 would skew every later reading."""
    import asyncio
    import threading
    import time

    from tandem.serving import ModelWorker

    worker = ModelWorker("depth")
    release = threading.Event()

    async def scenario():
        asyncio.get_running_loop().create_task(worker.run(release.wait, 5))
        await asyncio.sleep(0.05)
        assert worker.queue_depth == 1

    asyncio.run(scenario())  # cancels the waiting task and closes the loop; the call still runs
    assert worker.queue_depth == 1
    release.set()
    deadline = time.monotonic() + 5
    while worker.queue_depth and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.queue_depth == 0
    worker.shutdown()


def test_a_batch_of_calls_runs_in_one_span_under_its_most_urgent_calls_trace(recorded):
    """Three calls of three requests queue behind a lone one (--batch-verifies):
    the batch's compute span lies in the trace of its most urgent call, the
    priority-1 one, though another call launched it."""
    import asyncio

    from tandem.batcher import CallBatcher
    from tandem.serving import ModelWorker

    spans, _ = recorded
    tracer = TracerProvider().get_tracer("test")  # the requests' own spans, not recorded
    priorities = {"lone": 0, "late": 5, "urgent": 1, "later": 5}

    async def run():
        worker = ModelWorker("test-batch-span")
        batcher = CallBatcher(worker, lambda calls: list(calls), 8, lambda call: call, priorities.get,
                              span="tandem.target.compute")
        gate, traces = asyncio.Event(), {}

        async def request(call, alone=None):
            with tracer.start_as_current_span(f"request {call}") as span:
                traces[call] = span.get_span_context().trace_id
                return await batcher.submit(call, alone)

        async def held():
            await gate.wait()
            return "lone"

        try:
            lone = asyncio.ensure_future(request("lone", held))
            await asyncio.sleep(0)
            queued = [asyncio.ensure_future(request(call)) for call in ("late", "urgent", "later")]
            await asyncio.sleep(0)
            gate.set()
            return [await lone] + [await q for q in queued], traces
        finally:
            worker.shutdown()

    results, traces = asyncio.run(run())
    assert results == ["lone", "late", "urgent", "later"]
    (batch,) = [s for s in spans.get_finished_spans() if s.name == "tandem.target.compute"]
    assert batch.context.trace_id == traces["urgent"] != traces["late"]
