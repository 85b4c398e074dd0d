"""The decoder's scheduling logic with in-process services (no sockets)."""
import itertools

import pytest

from draft_service.drafters import ModelDrafter
from orchestrator.backends import ServiceUnavailable
from orchestrator.breaker import DraftBreaker
from orchestrator.decoder import Committed, Decoder, ServiceView
from orchestrator.inprocess import InProcessProposer, InProcessVerifier
from orchestrator.policy import KPolicy, KPolicyConfig
from tandem.modeling import ModelConfig, ModelRunner, load
from tandem.sampling import SamplingParams
from tandem.session_cache import SessionCacheStore
from target_service.verifier import Verifier
from tests.conftest import reference_greedy


def _services(model_dir: str):
    def runner_and_store():
        runner = ModelRunner(load(ModelConfig(model_dir, dtype="float32")), "cpu")
        return runner, SessionCacheStore(runner.new_cache)

    draft_runner, draft_store = runner_and_store()
    target_runner, target_store = runner_and_store()
    return (InProcessProposer(ModelDrafter(draft_runner, draft_store)),
            InProcessVerifier(Verifier(target_runner, target_store)))


async def _decode(proposer, verifier, prompt, tokens, pipeline, k=3, breaker=None, sampling=SamplingParams()):
    decoder = Decoder(proposer, verifier, f"s-{pipeline}-{k}", Committed(prompt), ServiceView(0), ServiceView(0),
                      sampling, KPolicy(KPolicyConfig(k=k, adaptive=False), pipeline), pipeline,
                      breaker=breaker)
    out = []
    rounds = decoder.rounds()
    async for newly in rounds:
        out += newly
        if len(out) >= tokens:
            break
    await rounds.aclose()
    return out[:tokens], decoder


@pytest.mark.parametrize("pipeline", [False, True])
async def test_in_process_decoder_matches_target_alone(tiny_models, pipeline):
    proposer, verifier = _services(tiny_models["target"])
    prompt = [4, 8, 15, 16, 23, 42]
    out, decoder = await _decode(proposer, verifier, prompt, 30, pipeline)
    assert out == reference_greedy(tiny_models["target"], prompt, 30)
    stats = decoder.stats
    assert stats.accepted == stats.drafted  # draft = target
    assert stats.rounds_per_k == [0, 0, 0, stats.rounds]  # k = 3 throughout
    if pipeline:
        # Every block is accepted whole and the draft guesses the bonus right, so
        # every round after the first verifies a pre-drafted block.
        assert stats.predraft_hits >= stats.rounds - 2
    assert stats.cache_misses == 0
    # Each round's overhead is filed by how its next block came: pre-drafted
    # (a hit) or drafted after the verify's reply (sequential, or a miss).
    assert len(stats.overhead_predrafted_ms) + len(stats.overhead_drafted_after_ms) == len(stats.overhead_ms)
    if pipeline:
        assert len(stats.overhead_predrafted_ms) == stats.predraft_hits
    else:
        assert stats.overhead_predrafted_ms == [] and len(stats.overhead_drafted_after_ms) == len(stats.overhead_ms)


async def test_views_follow_what_each_service_holds(tiny_models):
    proposer, verifier = _services(tiny_models["target"])
    out, decoder = await _decode(proposer, verifier, [1, 2, 3], 12, pipeline=False, k=2)
    committed = decoder.committed.tokens
    target_cache = verifier.verifier.store._sessions[decoder.session_id]
    draft_cache = proposer.drafter.store._sessions[decoder.session_id]
    for view, cache in ((decoder.target_view, target_cache), (decoder.draft_view, draft_cache)):
        assert view.length <= len(cache.tokens)
        assert cache.tokens[: view.length] == committed[: view.length]


class DownProposer:
    """Fails the calls numbered in `down` (from 1) with ServiceUnavailable, as
    the gRPC client does when the draft service is down."""

    def __init__(self, inner, down):
        self.inner, self.down, self.calls = inner, set(down), 0

    async def propose(self, *args, **kwargs):
        self.calls += 1
        if self.calls in self.down:
            raise ServiceUnavailable("UNAVAILABLE: the draft service is down")
        return await self.inner.propose(*args, **kwargs)


def test_the_breaker_backs_off_doubling_and_closes_on_success():
    now = [0.0]
    breaker = DraftBreaker(backoff_s=0.5, max_backoff_s=2.0, clock=lambda: now[0])
    assert breaker.allows() and not breaker.open
    for backoff in (0.5, 1.0, 2.0, 2.0):  # doubling, capped
        assert breaker.trip(ServiceUnavailable("down"))
        now[0] += backoff - 0.01
        assert not breaker.allows()
        now[0] += 0.01
        assert breaker.allows() and breaker.open  # the retry may go out
    breaker.reset()
    assert not breaker.open and breaker.allows()
    assert breaker.trip(ServiceUnavailable("down")) and breaker.retry_at == pytest.approx(now[0] + 0.5)
    breaker.pause()  # unpaired: no call at all, whatever the clock says
    now[0] += 100
    assert not breaker.allows() and breaker.open
    breaker.resume()
    assert breaker.allows() and not breaker.open
    assert not DraftBreaker(enabled=False).trip(ServiceUnavailable("down"))  # the caller raises
    with pytest.raises(ValueError):
        DraftBreaker(backoff_s=2.0, max_backoff_s=1.0)


@pytest.mark.parametrize("pipeline", [False, True])
async def test_rounds_go_on_on_the_target_alone_while_the_draft_is_down(tiny_models, pipeline):
    """Draft calls 2-4 fail (pre-drafts among them when pipelining): a round
    whose draft failed, or that the breaker's backoff kept from calling it,
    commits one target token; the draft is called again after the backoff and
    used again, and the output is the target alone's throughout."""
    proposer, verifier = _services(tiny_models["target"])
    down = DownProposer(proposer, down={2, 3, 4})
    ticks = itertools.count()
    breaker = DraftBreaker(backoff_s=0.5, max_backoff_s=1.0, clock=lambda: next(ticks) * 0.25)
    prompt = [4, 8, 15, 16, 23, 42]
    out, decoder = await _decode(down, verifier, prompt, 40, pipeline, breaker=breaker)
    assert out == reference_greedy(tiny_models["target"], prompt, 40)
    stats = decoder.stats
    assert stats.undrafted_rounds >= 1  # a failed pre-draft only costs its pre-drafted block
    assert down.calls > 4 and stats.drafted > 0 and not breaker.open  # drafting again after the failures
    assert stats.accepted == stats.drafted  # draft = target: what was drafted was accepted
    # Blocks of k = 3, or none while the draft is down.
    assert stats.rounds_per_k == [stats.undrafted_rounds, 0, 0, stats.rounds - stats.undrafted_rounds]


async def test_without_fallback_a_down_draft_fails_the_rounds(tiny_models):
    proposer, verifier = _services(tiny_models["target"])
    with pytest.raises(ServiceUnavailable):
        await _decode(DownProposer(proposer, down={2}), verifier, [1, 2, 3], 30, pipeline=False,
                      breaker=DraftBreaker(enabled=False))


def _propose_call(session, prefix, new_tokens, k):
    from draft_service.drafters import ProposeCall
    from tandem import fingerprint

    fp = fingerprint.prefix_table(prefix)[-1] if prefix else fingerprint.EMPTY
    return ProposeCall(session_id=session, prefix_len=len(prefix), prefix_fp=fp, new_tokens=new_tokens,
                       num_tokens=k, sampling=SamplingParams(), return_dists=False, first_is_bonus_guess=False)


def test_a_cancelled_draft_stops_between_layers_and_its_cache_goes_on_exactly(tiny_models):
    """A pre-draft cancelled mid-step stops at the next layer, not at the end of
    the step; the half-run step's keys and values are cropped, so the next call
    on the session drafts exactly what an uncancelled draft would have."""
    import threading

    runner = ModelRunner(load(ModelConfig(tiny_models["other"], dtype="float32")), "cpu")
    drafter = ModelDrafter(runner, SessionCacheStore(runner.new_cache))
    prompt = [4, 8, 15, 16, 23, 42]
    never = threading.Event()
    reference = drafter.propose(_propose_call("ref", [], prompt, 6), never).tokens
    assert len(reference) == 6

    first, second = runner.model.model.layers
    calls = {"first": 0, "second": 0}
    cancelled = threading.Event()

    def count_first(module, args, output):
        calls["first"] += 1
        if calls["first"] == 3:  # the third step: cancelled after its first layer
            cancelled.set()

    def count_second(module, args, output):
        calls["second"] += 1

    hooks = [first.register_forward_hook(count_first), second.register_forward_hook(count_second)]
    try:
        proposal = drafter.propose(_propose_call("s", [], prompt, 6), cancelled)
    finally:
        for hook in hooks:
            hook.remove()
    assert proposal.tokens == reference[:2]
    assert calls == {"first": 3, "second": 2}  # the third step never reached the second layer
    cache = drafter.store._sessions["s"]
    assert cache.kv_len == len(prompt) + 1
    assert [layer.get_seq_length() for layer in cache.kv.layers] == [cache.kv_len] * 2
    # The orchestrator's next call: the first drafted token committed, the second sent anew.
    after = drafter.propose(_propose_call("s", prompt + reference[:1], reference[1:2], 4), never)
    assert after.tokens == reference[2:6]


@pytest.mark.parametrize("backend", ["ngram", "ngram+model"])
async def test_history_drafters_pre_draft_what_they_would_draft_fresh(tiny_models, backend):
    """Prompt lookup decides from the history. A pre-draft after the bonus guess
    must propose what a call after the verify would (same tokens, same draft
    probabilities), or a seeded sampled run differs with the pipeline on and off."""
    from draft_service.drafters import NgramDrafter, NgramModelDrafter

    target = ModelRunner(load(ModelConfig(tiny_models["target"], dtype="float32")), "cpu")
    draft = ModelRunner(load(ModelConfig(tiny_models["target"], dtype="float32")), "cpu")
    prompt = [72, 122, 55] * 4
    for seed in range(6):
        sampling = SamplingParams(temperature=0.7, seed=seed)
        outputs = []
        for pipeline in (False, True):
            store = SessionCacheStore(draft.new_cache)
            drafter = NgramDrafter(store, 128, ngram_max=2) if backend == "ngram" else \
                NgramModelDrafter(draft, store, ngram_max=2)
            verifier = InProcessVerifier(Verifier(target, SessionCacheStore(target.new_cache)))
            out, _ = await _decode(InProcessProposer(drafter), verifier, prompt, 32, pipeline, k=1, sampling=sampling)
            outputs.append(out)
        assert outputs[0] == outputs[1], seed
