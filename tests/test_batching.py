"""The target's --batch-verifies: several sessions' blocks in one forward give
what each would alone, a queued verify waits for no more than the one running,
and end to end the output stays the target alone's."""
import asyncio
import threading

import pytest
import torch

from tandem import fingerprint
from tandem.batcher import CallBatcher
from tandem.lean import LeanRunner
from tandem.modeling import ModelConfig, load
from tandem.sampling import SamplingParams
from tandem.serving import ModelWorker
from tandem.session_cache import CacheMiss, SessionCacheStore
from target_service.verifier import Verifier, VerifyCall
from tests.conftest import DEVICE, Cluster, reference_greedy

HISTORIES = {"a": [(7 * i) % 120 + 1 for i in range(40)], "b": [5, 6, 7], "c": [(3 * i) % 100 + 9 for i in range(17)]}
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, seed=11)


@pytest.fixture(scope="module")
def runner(tiny_models):
    return LeanRunner(load(ModelConfig(tiny_models["target"], dtype="float32")), "cpu", fused=False)


def test_a_batched_forward_gives_each_feed_its_own_logits(runner):
    feeds, alone = [], []
    for tokens in HISTORIES.values():
        kv, twin = runner.new_cache(), runner.new_cache()
        runner.forward(kv, tokens, 1)
        runner.forward(twin, tokens, 1)
        feeds.append(kv)
        alone.append(twin)
    blocks = [[3, 4, 5, 6], [7], [9, 10, 11]]
    fresh = runner.new_cache()
    got = runner.forward_batch([*((kv, b, len(b)) for kv, b in zip(feeds, blocks)), (fresh, [1, 2, 3, 4, 5], 2)])
    expected = [runner.forward(kv, b, len(b)) for kv, b in zip(alone, blocks)]
    expected.append(runner.forward(runner.new_cache(), [1, 2, 3, 4, 5], 2))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    assert [kv.length for kv in feeds] == [len(h) + len(b) for h, b in zip(HISTORIES.values(), blocks)]
    assert fresh.length == 5


def _verifier(runner) -> Verifier:
    store = SessionCacheStore(runner.new_cache)
    for session, tokens in HISTORIES.items():
        cache, _ = store.checkout(session, 0, 0)
        runner.forward(cache.kv, tokens, 1)
        cache.append(tokens)
        cache.mark_fed()
    return Verifier(runner, store)


def _calls(sampling, logprobs: int | None = None) -> list[VerifyCall]:
    calls = []
    for i, (session, tokens) in enumerate(HISTORIES.items()):
        draft = [(11 * i + j) % 120 + 1 for j in range(3)]
        probs, dists = [], None
        if not sampling.greedy:
            dists = torch.softmax(torch.randn(3, 128, generator=torch.Generator().manual_seed(i)), dim=-1)
            probs = [float(dists[j, t]) for j, t in enumerate(draft)]
        calls.append(VerifyCall(session, len(tokens), fingerprint.of(tokens), [i + 1], draft, probs, dists, sampling,
                                logprobs=logprobs))
    return calls


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_batch_of_verifies_decides_as_each_would_alone(runner, sampling):
    batched, alone = _verifier(runner), _verifier(runner)
    calls = _calls(sampling, logprobs=3)
    outcomes = batched.verify_batch(calls)
    for call, outcome in zip(calls, outcomes):
        expected = alone.verify(call)
        assert (outcome.accepted, outcome.next_token, outcome.prefilled) == \
               (expected.accepted, expected.next_token, expected.prefilled)
        # Each committed token's log probability, and the 3 likeliest, as alone.
        assert len(outcome.logprobs) == len(expected.logprobs) == outcome.accepted + 1
        for got, want in zip(outcome.logprobs, expected.logprobs):
            assert got.top_tokens == want.top_tokens and len(got.top_tokens) == 3
            torch.testing.assert_close(torch.tensor([got.logprob, *got.top_logprobs]),
                                       torch.tensor([want.logprob, *want.top_logprobs]), atol=1e-5, rtol=0)
        assert batched.store.peek(call.session_id).tokens == alone.store.peek(call.session_id).tokens


def test_a_cache_miss_fails_its_own_call_only(runner):
    verifier = _verifier(runner)
    calls = _calls(GREEDY)
    calls[1] = VerifyCall("b", 3, fingerprint.of([9, 9, 9]), [1], [2, 3], [], None, GREEDY)
    outcomes = verifier.verify_batch(calls)
    assert isinstance(outcomes[1], CacheMiss)
    assert outcomes[0].prefilled == 1 and outcomes[2].prefilled == 1


def test_verifies_that_queue_behind_a_running_one_go_together(runner):
    async def run():
        worker = ModelWorker("test-target")
        verifier = _verifier(runner)
        batcher = CallBatcher(worker, verifier.verify_batch, 8, lambda call: call.session_id)
        try:
            calls = _calls(GREEDY)
            outcomes = await asyncio.gather(*(batcher.submit(call) for call in calls))
        finally:
            worker.shutdown()
        return batcher, outcomes

    batcher, outcomes = asyncio.run(run())
    assert (batcher.batches, batcher.batched_calls) == (2, 3)  # the first alone, then the two that queued
    alone = _verifier(runner)
    assert [o.next_token for o in outcomes] == [alone.verify(c).next_token for c in _calls(GREEDY)]


def test_a_verify_cancelled_while_queued_never_runs(runner):
    async def run():
        worker = ModelWorker("test-target")
        verifier = _verifier(runner)
        batcher = CallBatcher(worker, verifier.verify_batch, 8, lambda call: call.session_id)
        calls = _calls(GREEDY)
        try:
            first = asyncio.ensure_future(batcher.submit(calls[0]))
            queued = asyncio.ensure_future(batcher.submit(calls[1]))
            await asyncio.sleep(0)  # both are in: the first runs, the second waits
            queued.cancel()
            await first
            await asyncio.sleep(0.05)
        finally:
            worker.shutdown()
        return batcher, verifier

    batcher, verifier = asyncio.run(run())
    assert batcher.batched_calls == 1
    assert verifier.store.peek("b").tokens == HISTORIES["b"]  # untouched


def _with_a_lone_call(body):
    """Runs `await body(batcher, alone_of, first, gate)` on a fresh loop: a
    CallBatcher over plain calls (strings) on a real worker, with call "a"
    running alone (task `first`) until `gate` is set; alone_of(call) is a
    call's lone path. Returns (body's result, the calls run alone, the
    batches run)."""
    ran_alone, batches = [], []

    def run_batch(calls):
        batches.append(list(calls))
        return [f"{call}:batched" for call in calls]

    def alone_of(call, gate=None):
        async def alone():
            if gate is not None:
                await gate.wait()
            ran_alone.append(call)
            return f"{call}:alone"
        return alone

    async def run():
        worker = ModelWorker("test-batcher")
        batcher = CallBatcher(worker, run_batch, 8, lambda call: call)
        gate = asyncio.Event()
        try:
            first = asyncio.ensure_future(batcher.submit("a", alone_of("a", gate)))
            await asyncio.sleep(0)
            return await body(batcher, alone_of, first, gate)
        finally:
            worker.shutdown()

    return asyncio.run(run()), ran_alone, batches


def test_a_lone_call_runs_its_own_path_and_those_that_queue_go_together():
    """A call that finds nothing running runs by itself, through its `alone`
    (the unbatched path: its span, the inline rule, its cancellation); the
    calls that queue behind it go as one batch; a queue of one goes alone."""
    async def body(batcher, alone_of, first, gate):
        queued = [asyncio.ensure_future(batcher.submit(c, alone_of(c))) for c in ("b", "c")]
        await asyncio.sleep(0)
        gate.set()
        results = [await first] + [await q for q in queued]
        results.append(await batcher.submit("d", alone_of("d")))
        return batcher, results

    (batcher, results), ran_alone, batches = _with_a_lone_call(body)
    assert results == ["a:alone", "b:batched", "c:batched", "d:alone"]
    assert ran_alone == ["a", "d"] and batches == [["b", "c"]]
    assert (batcher.batches, batcher.batched_calls) == (3, 4)


def test_a_call_cancelled_as_its_lone_turn_comes_hands_the_turn_on():
    """The turn passes to a queued call (its future says: run alone) and its
    caller is cancelled before it resumes: the batcher must not stay busy, or
    every later call would wait for ever."""
    async def body(batcher, alone_of, first, gate):
        second = asyncio.ensure_future(batcher.submit("b", alone_of("b")))
        await asyncio.sleep(0)
        gate.set()
        await asyncio.sleep(0)  # "a" ended and gave "b" its turn; "b" has not resumed yet
        assert first.done() and not second.done()
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        return await asyncio.wait_for(batcher.submit("c", alone_of("c")), 5)

    result, ran_alone, batches = _with_a_lone_call(body)
    assert result == "c:alone"
    assert ran_alone == ["a", "c"] and batches == []


def _concurrently(cluster, prompts, k: int, meanwhile=None) -> list:
    """Each prompt from a client thread of its own, 40 greedy tokens with k
    draft tokens, all at once; meanwhile() runs while they do."""
    results = [None] * len(prompts)

    def one(i):
        with cluster.client() as client:
            results[i] = client.generate(prompt_ids=prompts[i], max_tokens=40, num_draft_tokens=k)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    if meanwhile is not None:
        meanwhile()
    for thread in threads:
        thread.join(120)
    return results


def test_concurrent_requests_on_a_batching_target_equal_the_target_alone(tiny_models):
    cluster = Cluster(tiny_models["target"], tiny_models["other"], target_batch=4)
    prompts = [[(13 * i + j) % 120 + 1 for j in range(10 + i)] for i in range(4)]
    try:
        results = _concurrently(cluster, prompts, k=2)
        stats = cluster.target.counts()
    finally:
        cluster.stop()
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference_greedy(tiny_models["target"], prompt, 40)
    assert stats["batched_verifies"] > stats["verify_batches"] > 0  # some forwards held several sessions


def test_the_batch_probe_runs_both_sides_and_gets_the_same_replies(char_models, tmp_path):
    """bench.batch_probe on the tiny pair: real processes, two deployments."""
    import json

    from bench.batch_probe import main

    out = tmp_path / "batch_probe.json"
    assert main(["--target", char_models["target"], "--draft", char_models["draft"], "--draft-args", "", "--dtype", "float32",
                 "--sides", "both_batched,unbatched", "--clients", "1,3", "--prompts", "code-1,code-2,prose-1",
                 "--new-tokens", "12", "--reps", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["rounds"] == 2 and result["identical_rounds"] == {"both_batched": 2}
    modes = result["modes"]
    assert list(modes) == ["both_batched", "unbatched"] and result["reference"] == "unbatched"
    for side in modes:
        assert all(modes[side][c]["tok_s"] > 0 for c in ("1", "3"))
    assert modes["unbatched"]["3"]["verifies_per_batch"] == modes["unbatched"]["3"]["drafts_per_batch"] == 0
    assert set(result["over_reference"]) == {"both_batched"}


# --- the draft's --batch-drafts ------------------------------------------------------

def _drafter(tiny_models, vocab_subset: int = 0):
    """The draft service's model drafter on the lean step (its layers per op), loaded as the service loads it."""
    from draft_service.model_drafter import ModelDrafter
    from draft_service.server import DraftOptions, _load_draft

    info, head = _load_draft(ModelConfig(tiny_models["other"], dtype="float32"), DraftOptions(vocab_subset=vocab_subset))
    runner = LeanRunner(info, "cpu", fused=False)
    store = SessionCacheStore(runner.new_cache)
    for session, tokens in HISTORIES.items():
        cache, _ = store.checkout(session, 0, 0)
        cache.append(tokens[:3])  # the rest comes as the calls' new tokens: a prefill beside one-token steps
    return ModelDrafter(runner, store, head)


def _propose_calls(alternatives: bool = False):
    from draft_service.drafters import ProposeCall

    calls = []
    for i, (session, tokens) in enumerate(HISTORIES.items()):
        new = tokens[3:] + [i + 1]  # "b" has no rest: its call feeds one token
        calls.append(ProposeCall(session, 3, fingerprint.of(tokens[:3]), new, num_tokens=3 + i, sampling=GREEDY,
                                 return_dists=False, first_is_bonus_guess=i == 1, alternatives=alternatives))
    return calls


@pytest.mark.parametrize("vocab_subset,alternatives", [(0, False), (100, False), (0, True)],
                         ids=["full-head", "reduced-head", "alternatives"])
def test_a_batch_of_drafts_proposes_what_each_would_alone(tiny_models, vocab_subset, alternatives):
    batched, alone = _drafter(tiny_models, vocab_subset), _drafter(tiny_models, vocab_subset)
    calls = _propose_calls(alternatives)
    proposals = batched.propose_batch([(call, threading.Event()) for call in calls])
    for call, proposal in zip(calls, proposals):
        expected = alone.propose(call, threading.Event())
        assert proposal.tokens == expected.tokens and len(proposal.tokens) == call.num_tokens
        assert proposal.alternatives == expected.alternatives
        assert (proposal.prefilled, proposal.cropped) == (expected.prefilled, expected.cropped)
        # The history is the prefix + new tokens + the block but its last token, fed, as alone.
        held = batched.store.peek(call.session_id)
        assert held.tokens == alone.store.peek(call.session_id).tokens
        assert held.tokens[-len(proposal.tokens) + 1:] == proposal.tokens[:-1]
        assert held.kv_len == len(held.tokens)


def test_a_batched_draft_that_misses_or_is_cancelled_fails_or_stops_alone(tiny_models):
    from draft_service.drafters import ProposeCall
    from tandem.session_cache import CacheMiss

    drafter = _drafter(tiny_models)
    calls = _propose_calls()
    calls[0] = ProposeCall("a", 3, fingerprint.of([9, 9, 9]), [1], 3, GREEDY, False, False)
    stopped = threading.Event()
    stopped.set()  # the caller went away before its first step
    proposals = drafter.propose_batch([(calls[0], threading.Event()), (calls[1], stopped),
                                       (calls[2], threading.Event())])
    assert isinstance(proposals[0], CacheMiss)
    assert proposals[1].tokens == [] and drafter.store.peek("b").tokens == HISTORIES["b"] + calls[1].new_tokens
    assert len(proposals[2].tokens) == calls[2].num_tokens
    assert proposals[2].tokens == _drafter(tiny_models).propose(calls[2], threading.Event()).tokens


def test_concurrent_requests_on_a_batching_draft_equal_the_target_alone(tiny_models):
    """Greedy requests from six clients against a draft service with
    --batch-drafts 4 (and a batching target): each output is the target alone's,
    and some draft batches held several sessions; a seeded sampled request
    among them gives the tokens it gives on a service that does not batch."""
    from draft_service.server import DraftOptions

    prompts = [[(13 * i + j) % 120 + 1 for j in range(10 + i)] for i in range(6)]
    sampled = dict(temperature=0.9, seed=5, num_draft_tokens=3)
    cluster = Cluster(tiny_models["target"], tiny_models["other"], target_batch=4,
                      draft_options=DraftOptions(batch_drafts=4), relay=False)  # the relay's drafts run alone
    seeded = []
    try:
        def meanwhile():
            with cluster.client() as client:
                seeded.append(client.generate(prompt_ids=prompts[0], max_tokens=24, **sampled))

        results = _concurrently(cluster, prompts, k=6, meanwhile=meanwhile)
        stats = cluster.draft.counts()
        backend = cluster.draft.backend
    finally:
        cluster.stop()
    assert "/batch=4" in backend
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference_greedy(tiny_models["target"], prompt, 40)
    assert stats["batched_drafts"] > stats["draft_batches"] > 0  # some batches held several sessions
    plain = Cluster(tiny_models["target"], tiny_models["other"], relay=False)
    try:
        with plain.client() as client:
            assert client.generate(prompt_ids=prompts[0], max_tokens=24, **sampled).token_ids == seeded[0].token_ids
    finally:
        plain.stop()


def test_batch_drafts_needs_the_model_backend_and_the_lean_step(tiny_models):
    from draft_service.server import DraftOptions, DraftServicer

    with pytest.raises(ValueError, match="model backend"):
        DraftOptions(backend="ngram", batch_drafts=2)
    with pytest.raises(ValueError, match="lean draft step"):
        DraftServicer(ModelConfig(tiny_models["other"], dtype="float32"), options=DraftOptions(batch_drafts=2,
                                                                                                lean_step="off"))


def test_batching_is_on_by_default_on_a_cpu_and_off_where_it_cannot_pay(tiny_models, monkeypatch):
    """--batch-verifies and --batch-drafts auto: 8 on a CPU for a model the lean
    forward runs; off on a GPU (not measured there), for the n-gram drafter,
    without the lean step, and where the target would verify token trees
    (bf16 on packed layers with AMX), which the lean forward does not."""
    from draft_service.server import AUTO_BATCH as DRAFT_AUTO, DraftOptions, auto_batch_drafts
    from tandem import cpu_kernels
    from target_service.server import AUTO_BATCH, TargetServicer, auto_batch_verifies

    class Runner:
        verifies_trees = True

    loaded = load(ModelConfig(tiny_models["target"], dtype="float32"))
    cpu = ModelConfig(tiny_models["target"], dtype="float32", linear="native")
    assert auto_batch_verifies(cpu, loaded, Runner()) == AUTO_BATCH == 8
    assert auto_batch_verifies(ModelConfig(tiny_models["target"], device="cuda:0"), loaded, Runner()) == 1
    assert auto_batch_drafts(cpu, DraftOptions(), Runner()) == DRAFT_AUTO == 8
    assert auto_batch_drafts(ModelConfig(tiny_models["target"], device="cuda:0"), DraftOptions(), Runner()) == 1
    assert auto_batch_drafts(cpu, DraftOptions(backend="ngram+model"), Runner()) == 1
    assert auto_batch_drafts(cpu, DraftOptions(), None) == 1  # Hugging Face's forward: no lean step
    for name in ("packed_available", "native_bf16", "amx_bf16"):
        monkeypatch.setattr(cpu_kernels, name, lambda: True)
    amx = ModelConfig(tiny_models["target"], dtype="bfloat16")
    assert amx.kernel == "packed" and auto_batch_verifies(amx, loaded, Runner()) == 1
    monkeypatch.undo()
    if DEVICE == "cpu":  # a service started with the defaults batches, and says so
        servicer = TargetServicer(ModelConfig(tiny_models["target"], dtype="float32"))
        try:
            assert servicer.batcher is not None and servicer.batcher.max_batch == 8
        finally:
            servicer.worker.shutdown()
