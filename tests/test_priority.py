"""Priority scheduling (--scheduling-policy priority, vLLM's request priority):
a model service's worker runs the lowest priority first, ties in arrival
order; the batcher fills its batches the same way; end to end, a request's
priority reaches the services' queues, and the output is still the target
alone's. With the default policy (fcfs) a priority other than 0 is refused."""
import asyncio
import concurrent.futures
import contextlib
import gc
import threading
import weakref

import grpc
import openai
import pytest

from tandem.batcher import CallBatcher
from tandem.serving import ModelWorker
from tests.conftest import Cluster, reference_greedy
from tests.test_http_api import _gateway, client


def _gated(worker: ModelWorker) -> threading.Event:
    """A call that holds the worker, running, until the event is set."""
    gate, started = threading.Event(), threading.Event()

    def hold():
        started.set()
        gate.wait()

    worker.submit(hold)
    assert started.wait(30)
    return gate


def test_the_worker_runs_the_lowest_priority_first_ties_in_arrival_order():
    worker = ModelWorker("test-priority")
    try:
        ran = []
        gate = _gated(worker)
        jobs = [worker.submit(ran.append, name, priority=priority)
                for name, priority in (("a", 5), ("b", 0), ("c", -1), ("d", 0), ("e", 5), ("f", -1))]
        dropped = worker.submit(ran.append, "dropped", priority=-9)
        assert dropped.cancel()  # not started: it never runs
        gate.set()
        concurrent.futures.wait(jobs, timeout=30)
        assert ran == ["c", "f", "b", "d", "a", "e"]
        assert worker.start_up(lambda: threading.current_thread().name) == "test-priority_0"

        async def one_at_a_time():  # run(): the same queue, awaited on a loop
            gate = _gated(worker)
            tasks = [asyncio.ensure_future(worker.run(ran.append, name, priority=p)) for name, p in
                     (("late", 3), ("urgent", -3), ("middle", 0))]
            await asyncio.sleep(0.05)
            assert worker.queue_depth == 3
            gate.set()
            await asyncio.gather(*tasks)

        ran.clear()
        asyncio.run(one_at_a_time())
        assert ran == ["urgent", "middle", "late"] and worker.queue_depth == 0
    finally:
        worker.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit(ran.append, "after shutdown")


def test_a_worker_keeps_nothing_alive_after_its_jobs_and_its_thread_ends_with_it():
    """What a job held (a service, its caches) is dropped once the job has
    run, and a worker no longer referenced is collected and its thread ends,
    as a ThreadPoolExecutor's does: a stopped service leaves nothing running."""
    class Held:
        pass

    worker = ModelWorker("test-priority-refs")
    held = Held()
    seen = weakref.ref(held)
    assert worker.submit(lambda thing: type(thing).__name__, held).result(30) == "Held"
    del held
    gc.collect()
    assert seen() is None
    thread = worker._thread
    del worker
    gc.collect()
    thread.join(30)
    assert not thread.is_alive()


def test_shutdown_cancels_what_has_not_started():
    worker = ModelWorker("test-priority-shutdown")
    gate = _gated(worker)
    queued = [worker.submit(lambda: None, priority=p) for p in (0, 1)]
    worker.shutdown()
    gate.set()
    assert all(job.cancelled() for job in queued)


class _RecordingWorker(ModelWorker):
    """A model worker that notes the priority each call queues with."""

    def __init__(self, name: str):
        super().__init__(name)
        self.priorities = []

    async def run(self, fn, *args, priority: int = 0, **kwargs):
        self.priorities.append(priority)
        return await super().run(fn, *args, priority=priority, **kwargs)


def test_the_draft_runs_a_waited_for_draft_before_a_pre_draft_of_its_priority():
    """A pre-draft (its first token a bonus guess) is speculative and runs
    beside its session's verify: within one priority it queues behind the
    drafts that sessions wait for, and ahead of every later priority."""
    from draft_service.drafters import ProposeCall
    from draft_service.server import queue_place
    from tandem.sampling import SamplingParams

    def call(priority: int, pre_draft: bool) -> ProposeCall:
        return ProposeCall("s", 0, 0, [1], 3, SamplingParams(), False, pre_draft, priority=priority)

    places = [queue_place(call(p, pre)) for p, pre in ((-1, False), (-1, True), (0, False), (0, True), (5, False))]
    assert places == sorted(places) and len(set(places)) == len(places)


def test_a_batcher_fills_its_batches_by_priority():
    """Five sessions queue behind a running batch of two: the next batches
    take the most urgent first (ties in arrival order), and each queues on
    the worker at its most urgent call's priority."""
    worker = _RecordingWorker("test-priority-batch")
    batches = []

    def run_batch(calls):
        batches.append([name for name, _ in calls])
        return [name for name, _ in calls]

    async def scenario():
        batcher = CallBatcher(worker, run_batch, 2, session_of=lambda call: call[0],
                              priority_of=lambda call: call[1])
        gate = _gated(worker)
        first = asyncio.ensure_future(batcher.submit(("first", 0)))  # runs at once, behind the gate
        await asyncio.sleep(0.05)
        later = [asyncio.ensure_future(batcher.submit(call))
                 for call in (("p4", 4), ("p1", 1), ("q4", 4), ("m2", -2), ("p1b", 1))]
        await asyncio.sleep(0.05)
        gate.set()
        return await asyncio.gather(first, *later)

    try:
        results = asyncio.run(scenario())
    finally:
        worker.shutdown()
    assert results == ["first", "p4", "p1", "q4", "m2", "p1b"]  # each call its own result
    assert batches == [["first"], ["m2", "p1"], ["p1b", "p4"], ["q4"]]
    assert worker.priorities == [0, -2, 1, 4]


@pytest.fixture(scope="module")
def cluster(tiny_models):
    # The target worker's own queue order, unbatched (a batching target's:
    # test_a_batcher_fills_its_batches_by_priority).
    cluster = Cluster(tiny_models["target"], tiny_models["other"], inline_compute="off", target_batch=1,
                      orchestrator={"scheduling_policy": "priority",
                                    "tenant_priorities": {"premium": -5, "free": 0}})
    yield cluster
    cluster.stop()


@contextlib.contextmanager
def _verified_priorities(target):
    """The priority of each verify the target service runs, in order, while in the block."""
    seen, verify = [], target.verifier.verify

    def recording(call, *args, **kwargs):
        seen.append(call.priority)
        return verify(call, *args, **kwargs)

    target.verifier.verify = recording
    try:
        yield seen
    finally:
        target.verifier.verify = verify


def test_a_requests_priority_orders_its_calls_on_the_target(cluster, tiny_models):
    """Three requests of priority 5 and then one of -1 queue on a target that
    is busy: the -1 request's call runs first. Each output equals the target
    alone's."""
    target = cluster.target
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [10, 20, 30, 40, 50], [7, 7, 7, 8, 9], [11, 12, 13, 14, 15, 16]]
    priorities = [5, 5, 5, -1]
    gate = threading.Event()
    held = asyncio.run_coroutine_threadsafe(target.worker.run(gate.wait), cluster.loop)
    with _verified_priorities(target) as seen:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            futures = []
            for prompt, priority in zip(prompts, priorities):
                futures.append(pool.submit(_generate, cluster, prompt, priority))
                for _ in range(400):  # its first target call queued, behind the gate and those before it
                    if target.worker.queue_depth >= len(futures) + 1:
                        break
                    threading.Event().wait(0.01)
                assert target.worker.queue_depth == len(futures) + 1
            gate.set()
            held.result(30)
            results = [future.result(120) for future in futures]
    # The -1 request's first call ran first, ahead of the three queued before it.
    # (Its next verify, once drafted, may run ahead of 5s still queued then.)
    assert seen[0] == -1 and seen[1] == 5
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference_greedy(tiny_models["target"], prompt, 12)


def _generate(cluster: Cluster, prompt: list[int], priority: int):
    with cluster.client() as api:
        return api.generate(prompt_ids=prompt, max_tokens=12, priority=priority)


def test_a_tenants_priority_is_its_default_and_the_earliest_it_may_ask_for(cluster, tiny_models):
    """--tenant-priority premium=-5 free=0: each tenant's requests run at its
    priority unless they ask for a later one; an earlier one is
    PERMISSION_DENIED and touches nothing. Other tenants ask as they like."""
    prompt = [3, 1, 4, 1, 5, 9]
    expected = reference_greedy(tiny_models["target"], prompt, 4)
    with _verified_priorities(cluster.target) as seen:
        for tenant, asked, runs in (("premium", None, -5), ("premium", 2, 2), ("free", None, 0), ("free", 7, 7),
                                    (None, -9, -9)):
            seen.clear()
            with cluster.client(tenant=tenant) as api:
                assert api.generate(prompt_ids=prompt, max_tokens=4, priority=asked).token_ids == expected
            assert seen and set(seen) == {runs}, (tenant, asked)
        for tenant, asked in (("premium", -6), ("free", -1)):
            with cluster.client(tenant=tenant) as api, pytest.raises(grpc.RpcError) as caught:
                api.generate(prompt_ids=prompt, max_tokens=4, priority=asked)
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert f"tenant {tenant!r} may ask for priority" in caught.value.details()


def test_tenant_priorities_are_checked_at_start():
    from orchestrator.config import OrchestratorConfig
    from tandem.cli_flags import build_parser

    with pytest.raises(ValueError, match="need the priority scheduling policy"):
        OrchestratorConfig(draft_address="a:1", target_address="b:2", tenant_priorities={"x": 1})
    args = build_parser().parse_args(["serve", "orchestrator", "--scheduling-policy", "priority",
                                      "--tenant-priority", "premium=-1", "--tenant-priority", "*=0"])
    assert dict(args.tenant_priority) == {"premium": -1, "*": 0}
    for bad in ("premium", "=3", "x=1.5"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "orchestrator", "--tenant-priority", bad])


def test_the_http_api_takes_vllms_priority(cluster, tiny_models):
    base, stop = _gateway(cluster)
    try:
        answer = client(base).completions.create(model=None, prompt=[3, 1, 4, 1, 5], max_tokens=8, temperature=0,
                                                 extra_body={"priority": -7, "return_token_ids": True})
        assert answer.choices[0].token_ids == reference_greedy(tiny_models["target"], [3, 1, 4, 1, 5], 8)
        with pytest.raises(openai.BadRequestError, match="'priority' must be an integer") as refused:
            client(base).completions.create(model=None, prompt=[3, 1], max_tokens=2, extra_body={"priority": 1.5})
        assert refused.value.body["param"] == "priority"
    finally:
        stop()


def test_the_responses_api_passes_the_priority_on():
    from orchestrator.openai_responses import responses_call

    assert responses_call({"input": "hello", "priority": -3}).request.params.priority == -3
    assert not responses_call({"input": "hello"}).request.params.HasField("priority")


def test_first_come_first_served_refuses_a_priority(tiny_models):
    cluster = Cluster(tiny_models["target"], tiny_models["other"])  # the default policy, fcfs
    try:
        with cluster.client() as api:
            with pytest.raises(grpc.RpcError) as caught:
                api.generate(prompt_ids=[3, 1, 4], max_tokens=2, priority=1)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "--scheduling-policy priority" in caught.value.details()
            assert len(api.generate(prompt_ids=[3, 1, 4], max_tokens=2, priority=0).token_ids) == 2
        base, stop = _gateway(cluster)
        try:
            with pytest.raises(openai.BadRequestError, match="--scheduling-policy priority"):
                client(base).completions.create(model=None, prompt=[3, 1, 4], max_tokens=2,
                                                extra_body={"priority": 1})
        finally:
            stop()
    finally:
        cluster.stop()


def test_the_worker_counts_the_time_its_calls_ran_on_its_thread_and_inline():
    import asyncio
    import time

    from tandem.serving import ModelWorker

    worker = ModelWorker("busy", inline=True)
    try:
        worker.submit(time.sleep, 0.05).result(5)
        assert 0.05 <= worker.busy_s < 1.0

        async def inline():
            await worker.run(time.sleep, 0.05, short=True)  # the worker is idle: it runs on this thread

        asyncio.run(inline())
        assert worker.inline_calls == 1 and 0.1 <= worker.busy_s < 1.5
    finally:
        worker.shutdown()


def test_the_priority_probe_runs_on_the_tiny_pair_with_the_same_foreground_on_both_sides(char_models, tmp_path):
    """bench.priority_probe on the tiny pair: real processes; the foreground's
    tokens are the same at either priority, and the services' busy shares
    and calls per token are read over its window."""
    import json

    from bench.priority_probe import main

    out = tmp_path / "priority_probe.json"
    assert main(["--target", char_models["target"], "--draft", char_models["draft"], "--draft-args", "", "--dtype", "float32",
                 "--background", "1", "--new-tokens", "16", "--foreground-tokens", "8", "--reps", "1",
                 "--settle", "0.5", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["identical_foregrounds"] == result["passes"] == 1
    for mode in result["modes"].values():
        assert 0 < mode["median_target_busy_share"] <= 1.05 and 0 < mode["median_draft_busy_share"] <= 1.05
        assert mode["median_target_calls_per_token"] > 0 and mode["median_draft_calls_per_token"] > 0
