"""The relay (target_service.relay, draft_service.prepared): the target sends
its verdict's next draft call straight to the draft service. Over real gRPC
and Redis: outputs stay exactly the target's, the drafts after rejections are
the relayed ones, and a prepare that does not fit is never used."""
import asyncio
import concurrent.futures
import contextlib
import threading
import time

import grpc
import pytest

from draft_service.server import DraftOptions
from tandem import fingerprint
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2
from target_service.relay import next_request
from tests.conftest import Cluster, reference_greedy

PROMPT = [5, 17, 99, 3, 42, 8, 8, 120]


@pytest.fixture(scope="module")
def relay_cluster(tiny_models):
    """An unrelated draft: nearly every round ends at a rejection."""
    # The draft's own queue, unbatched (a batching draft's: the batched tests below).
    cluster = Cluster(tiny_models["target"], tiny_models["other"], k=3, draft_options=DraftOptions(batch_drafts=1))
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("pipeline", [False, True])
def test_drafts_after_rejections_are_begun_by_the_relay_and_output_is_exact(relay_cluster, tiny_models, pipeline):
    with relay_cluster.client() as client:
        result = client.generate(prompt_ids=PROMPT, max_tokens=40, pipeline=pipeline)
    assert result.token_ids == reference_greedy(tiny_models["target"], PROMPT, 40)
    stats = result.stats
    assert stats.rejected_rounds > 10
    # Nearly every draft after a verify's reply was begun by the relay: not the
    # first few (the relay's stream opens on the first verify that asks for it),
    # nor the odd one whose orchestrator call reached the draft before the
    # relayed one (a race that a machine busy with other tests loses more often).
    # The rounds that drafted (not a turn's first, nor a last round that wants one token) and
    # whose block was not pre-drafted.
    drafted_after = stats.rounds - stats.rounds_per_k[0] - stats.predraft_hits
    assert 0.85 * drafted_after - 1 <= stats.relayed_drafts <= drafted_after
    assert relay_cluster.draft.prepared.used >= stats.relayed_drafts


def test_a_seeded_sampled_run_is_the_same_with_the_relay_on_and_off(tiny_models):
    params = dict(prompt_ids=PROMPT, max_tokens=30, temperature=0.9, top_p=0.95, seed=1234, num_draft_tokens=3)
    outputs = {}
    for relay in (True, False):
        cluster = Cluster(tiny_models["target"], tiny_models["other"], k=3, relay=relay)
        try:
            with cluster.client() as client:
                runs = [client.generate(pipeline=pipeline, **params) for pipeline in (False, True)]
        finally:
            cluster.stop()
        assert runs[0].token_ids == runs[1].token_ids
        assert (sum(r.stats.relayed_drafts for r in runs) > 0) == relay
        outputs[relay] = runs[0].token_ids
    assert outputs[True] == outputs[False]


def test_a_draft_service_the_target_cannot_reach_costs_nothing_but_the_relay(tiny_models):
    cluster = Cluster(tiny_models["target"], tiny_models["other"], k=3, relay_address="127.0.0.1:1")
    try:
        with cluster.client() as client:
            for pipeline in (False, True):
                result = client.generate(prompt_ids=PROMPT, max_tokens=30, pipeline=pipeline)
                assert result.token_ids == reference_greedy(tiny_models["target"], PROMPT, 30)
                assert result.stats.relayed_drafts == 0
                assert result.stats.undrafted_rounds == 0
        assert cluster.target.relay.sent + cluster.target.relay.dropped > 0
    finally:
        cluster.stop()


# --- the draft service's side, one call at a time ------------------------------
def _request(session, prefix_tokens, new_tokens, k):
    return draft_pb2.ProposeRequest(
        session_id=session, new_tokens=new_tokens, num_tokens=k,
        prefix=common_pb2.PrefixRef(length=len(prefix_tokens), fingerprint=fingerprint.of(prefix_tokens)))


class DraftCalls:
    """Propose and Prepare on one draft service, in the cluster's loop."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.channel = cluster.run(self._open())

    async def _open(self):
        return grpc.aio.insecure_channel(self.cluster.draft_address)

    def propose(self, request):
        return self.cluster.run(self._propose(request))

    async def _propose(self, request):
        return await draft_pb2_grpc.DraftServiceStub(self.channel).Propose(request)

    def propose_later(self, request) -> concurrent.futures.Future:
        """The call sent now; its reply (or rpc error) when it comes."""
        return asyncio.run_coroutine_threadsafe(self._propose(request), self.cluster.loop)

    def prepare(self, *requests) -> tuple[int, int]:
        """(requests received, those that drafted)."""
        prepared = self.cluster.draft.prepared

        async def send():
            drafted = prepared.started
            summary = await draft_pb2_grpc.DraftServiceStub(self.channel).Prepare(iter(requests))
            await asyncio.sleep(0.2)  # the drafting it began runs on
            return summary.received, prepared.started - drafted

        return self.cluster.run(send())

    def close(self):
        self.cluster.run(self.channel.close())


def test_a_call_takes_the_prepared_reply_only_when_it_names_the_same_history_and_length(relay_cluster):
    calls = DraftCalls(relay_cluster)
    try:
        def round_one(session):
            first = calls.propose(_request(session, [], PROMPT, 3))
            return PROMPT + list(first.tokens[:-1]), list(first.tokens)

        held, drafted = round_one("prep-a")
        round_one("prep-b")  # the reference: the same calls, never prepared
        # A verdict after that block: one accepted, then the target's token 9.
        history, new = held[:len(PROMPT) + 1], [9]
        assert calls.prepare(_request("prep-a", history, new, 4)) == (1, 1)
        taken = calls.propose(_request("prep-a", history, new, 4))
        reference = calls.propose(_request("prep-b", history, new, 4))
        assert taken.prepared and not reference.prepared
        assert list(taken.tokens) == list(reference.tokens)
        assert taken.compute_ms > 0 and taken.handler_ms >= taken.compute_ms

        # Another length than the one prepared: the prepare is dropped, the call runs.
        history = history + [9] + list(taken.tokens[:-1])
        calls.prepare(_request("prep-a", history[:-1], history[-1:], 2))
        other = calls.propose(_request("prep-a", history[:-1], history[-1:], 3))
        reference = calls.propose(_request("prep-b", history[:-1], history[-1:], 3))
        assert not other.prepared and list(other.tokens) == list(reference.tokens)

        # A prepare that comes after its call is skipped: the cache stays where the
        # call left it, so a pre-draft naming that state still finds it.
        late = _request("prep-a", history[:-1], history[-1:], 3)
        used = relay_cluster.draft.prepared.used
        assert calls.prepare(late) == (1, 0)
        ahead = history + list(other.tokens[:-1])
        pre = draft_pb2.ProposeRequest(
            session_id="prep-a", new_tokens=other.tokens[-1:], num_tokens=2, first_is_bonus_guess=True,
            prefix=common_pb2.PrefixRef(length=len(ahead), fingerprint=fingerprint.of(ahead)))
        assert len(calls.propose(pre).tokens) == 2
        assert relay_cluster.draft.prepared.used == used
    finally:
        calls.close()


def test_a_prepare_for_a_history_the_draft_holds_a_session_it_lacks_or_a_bad_call_drafts_nothing(relay_cluster):
    calls = DraftCalls(relay_cluster)
    try:
        first = calls.propose(_request("prep-c", [], PROMPT, 4))
        held = PROMPT + list(first.tokens[:-1])
        assert calls.prepare(
            _request("prep-c", held[:-2], held[-2:], 3),  # held whole: a pre-draft that hit
            _request("prep-unknown", PROMPT, [1], 3),  # never seen
            _request("prep-c", [], [1], 3),  # would start the session afresh
            _request("prep-c", held[:-1], held[-1:], 0),  # fails Propose's checks: ignored
        ) == (4, 0)
        # The cache still holds what the first call left.
        assert not calls.propose(_request("prep-c", held[:-1], held[-1:], 2)).prepared
    finally:
        calls.close()


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


@contextlib.contextmanager
def _held(cluster):
    """The draft's worker held until the block ends (or the gate it yields is set)."""
    gate = threading.Event()
    worker = cluster.draft.worker
    holding = asyncio.run_coroutine_threadsafe(worker.run(gate.wait), cluster.loop)
    try:
        _until(lambda: worker.queue_depth == 1, "the worker was not held")
        yield gate
    finally:
        gate.set()
        holding.result(30)


def _pre_draft_after_the_later_call(cluster, session: str, batched: bool) -> None:
    """The race below, set up: the draft's worker is held while a pre-draft
    and then the draft after its verdict's rejection arrive; the later call
    runs first, then the pre-draft's turn comes."""
    calls = DraftCalls(cluster)
    draft = cluster.draft
    try:
        block = list(calls.propose(_request(session, [], PROMPT, 1)).tokens)  # holds PROMPT
        with _held(cluster):
            if batched:  # another session's call: a batch that runs after the gate, so the two below wait together
                other = calls.propose_later(_request(f"{session}-other", [], PROMPT[:4], 2))  # no prefill chunk
                _until(lambda: draft.worker.queue_depth == 2, "the other session's batch never queued")
            # Beside the verify of `block`: the pre-draft that assumes it accepted.
            pre = calls.propose_later(draft_pb2.ProposeRequest(
                session_id=session, new_tokens=block, num_tokens=3, first_is_bonus_guess=True,
                prefix=common_pb2.PrefixRef(length=len(PROMPT), fingerprint=fingerprint.of(PROMPT))))
            waiting = ((lambda n: draft.batcher.waiting == n) if batched
                       else (lambda n: draft.worker.queue_depth == n + 1))
            _until(lambda: waiting(1), "the pre-draft never queued")
            # The target rejected the block and took another token: the draft after that verdict.
            verdict = block[0] % 120 + 1
            after = calls.propose_later(_request(session, PROMPT, [verdict], 3))
            _until(lambda: waiting(2), "the draft after the verdict never queued")
            overtaken = draft.prepared.overtaken
        drafted = list(after.result(60).tokens)
        with pytest.raises(grpc.aio.AioRpcError) as missed:
            pre.result(60)
        assert missed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "a later call of the session reached the draft first" in missed.value.details()
        assert draft.counts()["predrafts_overtaken"] == overtaken + 1
        if batched:
            other.result(60)
        # The orchestrator's next call: that block accepted whole, and the target's token.
        history = PROMPT + [verdict] + drafted[:-1]
        assert len(calls.propose(_request(session, history, drafted[-1:] + [7], 2)).tokens) == 2
    finally:
        calls.close()


def test_a_pre_draft_overtaken_in_the_queue_by_a_later_call_leaves_that_call_s_cache(relay_cluster):
    """A pre-draft queues behind the drafts that the orchestrator waits for
    (draft_service.server.queue_place). After a rejection the relayed draft,
    or the orchestrator's own, may reach the draft service before the
    orchestrator's cancel of the pre-draft does, and then it runs first. The
    pre-draft must not run after it: its prefix (here, the history before a
    one-token block) is still in the cache, and it would crop the later
    call's tokens away, so that the orchestrator's next call missed. It is
    answered as a miss, which the orchestrator takes as no pre-draft."""
    _pre_draft_after_the_later_call(relay_cluster, "overtaken", batched=False)


def test_a_pre_draft_overtaken_in_a_batch_queue_leaves_that_call_s_cache(tiny_models):
    """The same with --batch-drafts: the two wait for a batch together, and
    the batch takes the later call (one call a session, the lowest place first)."""
    cluster = Cluster(tiny_models["target"], tiny_models["other"], draft_options=DraftOptions(batch_drafts=4))
    try:
        _pre_draft_after_the_later_call(cluster, "overtaken-batched", batched=True)
    finally:
        cluster.stop()


def test_a_bonus_call_that_a_later_call_on_a_history_it_extends_overtook_still_runs(relay_cluster):
    """A draft relayed after a request's last verdict may start after the next
    turn's first call (a bonus call) reached the draft, and run before it. That
    draft's history is a prefix of the turn's, so the turn's call runs after
    it, as it would have alone: the same tokens, and its cache for the next call."""
    calls = DraftCalls(relay_cluster)
    turn = [3, 4, 5]
    worker = relay_cluster.draft.worker

    def first_call(session):
        return draft_pb2.ProposeRequest(
            session_id=session, new_tokens=turn, num_tokens=3, first_is_bonus_guess=True,
            prefix=common_pb2.PrefixRef(length=len(PROMPT), fingerprint=fingerprint.of(PROMPT)))

    try:
        for session in ("extended", "extended-alone"):
            calls.propose(_request(session, [], PROMPT, 2))  # holds PROMPT and a drafted token
        overtaken = relay_cluster.draft.prepared.overtaken
        with _held(relay_cluster):
            first = calls.propose_later(first_call("extended"))
            _until(lambda: worker.queue_depth == 2, "the turn's call never queued")
            relayed = calls.propose_later(_request("extended", PROMPT[:-1], PROMPT[-1:], 2))
            _until(lambda: worker.queue_depth == 3, "the relayed draft never queued")
        relayed.result(60)
        drafted = list(first.result(60).tokens)
        assert relay_cluster.draft.prepared.overtaken == overtaken
        assert drafted == list(calls.propose(first_call("extended-alone")).tokens)
        history = PROMPT + turn + drafted[:-1]
        assert len(calls.propose(_request("extended", history, drafted[-1:] + [7], 2)).tokens) == 2
    finally:
        calls.close()


def test_two_calls_part_where_their_histories_differ_within_the_shorter():
    from draft_service.drafters import ProposeCall
    from draft_service.prepared import parts
    from tandem.sampling import SamplingParams

    def call(prefix, new):
        return ProposeCall("s", len(prefix), fingerprint.of(prefix), new, 2, SamplingParams(), False, False)

    base = [5, 6, 7, 8]
    pre_draft = call(base, [9])  # the block [.., 9] accepted whole, assumed
    assert parts(call(base[:3], [8, 1]), pre_draft)  # the verdict took 1 where the block had 9
    assert parts(call(base, [1]), pre_draft) and parts(pre_draft, call(base, [1]))
    assert not parts(call(base[:3], [8]), pre_draft)  # a prefix of it
    assert not parts(call(base, [9, 4]), pre_draft)  # it extends the pre-draft's
    # The shorter history ends before the other's prefix: not told here (a checkout of that prefix tells).
    assert not parts(call([5], [1]), pre_draft)


def test_next_request_names_what_the_draft_holds_and_brings_the_verdict():
    verify = target_pb2.VerifyRequest(
        session_id="s", prefix=common_pb2.PrefixRef(length=3, fingerprint=fingerprint.of([1, 2, 3])),
        new_tokens=[4], draft_tokens=[10, 11, 12], relay=target_pb2.Relay(draft_address="d:1", num_tokens=5))
    for accepted, next_token, held, new in [(0, 7, [1, 2, 3, 4], [7]), (2, 7, [1, 2, 3, 4, 10, 11], [7]),
                                            (3, 13, [1, 2, 3, 4, 10, 11], [12, 13])]:
        request = next_request(verify, accepted, next_token)
        assert (request.prefix.length, request.prefix.fingerprint) == (len(held), fingerprint.of(held))
        assert list(request.new_tokens) == new
        assert (request.session_id, request.num_tokens) == ("s", 5)


def test_beside_a_pre_draft_only_rejections_are_relayed(same_cluster, tiny_models):
    """Draft = target: every block is accepted whole. Sequential, every draft is
    relayed; pipelined, the pre-drafts are used and nothing is relayed."""
    relay = same_cluster.target.relay
    with same_cluster.client() as client:
        for pipeline in (False, True):
            sent = relay.sent
            result = client.generate(prompt_ids=PROMPT, max_tokens=40, num_draft_tokens=3, pipeline=pipeline)
            assert result.token_ids == reference_greedy(tiny_models["target"], PROMPT, 40)
            stats = result.stats
            assert stats.rejected_rounds == 0
            if pipeline:
                assert stats.predraft_hits > 0
                assert (stats.relayed_drafts, relay.sent - sent) == (0, 0)
            else:
                assert stats.rounds - 4 <= stats.relayed_drafts <= stats.rounds - 2
