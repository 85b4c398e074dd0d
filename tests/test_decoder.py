"""The decoder's scheduling logic with in-process services (no sockets)."""
import asyncio
import itertools

import pytest

from draft_service.model_drafter import ModelDrafter
from orchestrator.backends import ServiceUnavailable
from orchestrator.breaker import DraftBreaker
from orchestrator.decoder import Decoder
from orchestrator.rounds import Committed, ServiceView
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


async def _decode(proposer, verifier, prompt, tokens, pipeline, k=3, breaker=None, sampling=SamplingParams(),
                  prefill_overlap=True):
    decoder = Decoder(proposer, verifier, f"s-{pipeline}-{k}", Committed(prompt), ServiceView(0), ServiceView(0),
                      sampling, KPolicy(KPolicyConfig(k=k, adaptive=False), pipeline), pipeline,
                      breaker=breaker, prefill_overlap=prefill_overlap)
    out = []
    rounds = decoder.rounds()
    async for newly in rounds:
        out += newly
        if len(out) >= tokens:
            break
    await rounds.aclose()
    return out[:tokens], decoder


@pytest.mark.parametrize("prefill_overlap", [True, False])
@pytest.mark.parametrize("pipeline", [False, True])
async def test_in_process_decoder_matches_target_alone(tiny_models, pipeline, prefill_overlap):
    proposer, verifier = _services(tiny_models["target"])
    prompt = [4, 8, 15, 16, 23, 42]
    out, decoder = await _decode(proposer, verifier, prompt, 30, pipeline, prefill_overlap=prefill_overlap)
    assert out == reference_greedy(tiny_models["target"], prompt, 30)
    stats = decoder.stats
    assert stats.accepted == stats.drafted  # draft = target
    if prefill_overlap:  # the first round prefills and decodes on the target; k = 3 after it
        assert stats.rounds_per_k == [1, 0, 0, stats.rounds - 1]
    else:
        assert stats.rounds_per_k == [0, 0, 0, stats.rounds]  # k = 3 throughout
    if pipeline:
        # Every block is accepted whole and the draft guesses the bonus right, so
        # every round after the first verifies a pre-drafted block; with the
        # prefill overlapped, so does the second (its block was drafted beside
        # the prefill, after a right guess of the target's first token).
        assert stats.predraft_hits >= stats.rounds - (1 if prefill_overlap else 2)
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


class Gate:
    """Holds each service's calls until the other service has one out: a
    decoder that calls one only after the other's reply never gets past it."""

    def __init__(self):
        self.draft_out, self.target_out = asyncio.Event(), asyncio.Event()
        self.log = []


class GatedProposer:
    def __init__(self, inner, gate: Gate):
        self.inner, self.gate = inner, gate

    async def propose(self, session_id, prefix, new_tokens, k, sampling, bonus_guess=False, alternatives=False):
        self.gate.log.append(("draft", prefix.length, len(new_tokens), k, bonus_guess))
        self.gate.draft_out.set()
        await asyncio.wait_for(self.gate.target_out.wait(), 10)
        return await self.inner.propose(session_id, prefix, new_tokens, k, sampling, bonus_guess=bonus_guess,
                                        alternatives=alternatives)


class GatedVerifier:
    def __init__(self, inner, gate: Gate):
        self.inner, self.gate = inner, gate

    async def verify(self, session_id, prefix, new_tokens, block, sampling):
        self.gate.log.append(("target", prefix.length, len(new_tokens), len(block.tokens)))
        self.gate.target_out.set()
        await asyncio.wait_for(self.gate.draft_out.wait(), 10)
        return await self.inner.verify(session_id, prefix, new_tokens, block, sampling)


@pytest.mark.parametrize("pipeline", [False, True])
async def test_the_draft_prefills_a_prompt_beside_the_target(tiny_models, pipeline):
    """A turn's first round: the target prefills the prompt and decodes one
    token while the draft prefills the same prompt, both calls out at once
    (each is held until the other's is out); pipelined, the draft also
    pre-drafts after its guess of that token. Then the rounds go on as usual,
    and the output is the target alone's."""
    proposer, verifier = _services(tiny_models["target"])
    gate = Gate()
    prompt = [4, 8, 15, 16, 23, 42]
    out, decoder = await _decode(GatedProposer(proposer, gate), GatedVerifier(verifier, gate), prompt, 20, pipeline)
    assert out == reference_greedy(tiny_models["target"], prompt, 20)
    first_two = sorted(gate.log[:2])
    ahead = decoder.policy.k_ahead if pipeline else 0
    assert first_two == [("draft", 0, len(prompt), 1 + ahead, True), ("target", 0, len(prompt), 0)]
    assert decoder.stats.rounds_per_k[0] == 1 and decoder.stats.cache_misses == 0
    if pipeline:  # draft = target: the guess is right and its block is verified next
        assert decoder.stats.predraft_hits >= decoder.stats.rounds - 1
    # A second turn, as Generation starts one: the services' views without their
    # speculative tails; its new tokens are prefilled the same way, from what
    # each service holds.
    history = decoder.committed.tokens + [7, 7, 9]
    gate = Gate()
    second = Decoder(GatedProposer(proposer, gate), GatedVerifier(verifier, gate), decoder.session_id,
                     Committed(history), ServiceView(min(decoder.draft_view.length, len(history))),
                     ServiceView(min(decoder.target_view.length, len(history))), SamplingParams(),
                     KPolicy(KPolicyConfig(k=3, adaptive=False), pipeline), pipeline)
    rounds, more = second.rounds(), []
    async for newly in rounds:
        more += newly
        if len(more) >= 5:
            break
    await rounds.aclose()
    assert more[:5] == reference_greedy(tiny_models["target"], history, 5)
    (draft, *_), (target, *_) = sorted(gate.log[:2])
    assert (draft, target) == ("draft", "target") and second.stats.cache_misses == 0
    assert gate.log[0][1] > 0 and gate.log[1][1] > 0  # neither resent the first turn


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
    # Blocks of k = 3, or none while the draft is down and in the first round (the prompt's prefill).
    assert stats.rounds_per_k == [stats.undrafted_rounds + 1, 0, 0, stats.rounds - stats.undrafted_rounds - 1]


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
    from draft_service.drafters import NgramDrafter
    from draft_service.model_drafter import NgramModelDrafter

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


class CountingPolicy(KPolicy):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.observed = 0

    def observe(self, *args):
        self.observed += 1
        super().observe(*args)


class WatchingVerifier:
    """Notes, at each verify, how many rounds were committed and how many the policy had taken in."""

    def __init__(self, inner):
        self.inner, self.decoder, self.seen = inner, None, []

    async def verify(self, session_id, prefix, new_tokens, block, sampling):
        self.seen.append((self.decoder.stats.rounds, self.decoder.policy.observed))
        return await self.inner.verify(session_id, prefix, new_tokens, block, sampling)


@pytest.mark.parametrize("pipeline", [False, True])
async def test_the_policy_learns_each_round_after_the_next_calls_are_out(tiny_models, pipeline):
    """A round's observation reaches the adaptive policy once the next round's
    calls are out (its choice is off the critical path), and before the
    round's tokens are handed over: none is lost or taken twice."""
    proposer, inner = _services(tiny_models["target"])
    verifier = WatchingVerifier(inner)
    decoder = Decoder(proposer, verifier, f"learn-{pipeline}", Committed([4, 8, 15, 16]), ServiceView(0),
                      ServiceView(0), SamplingParams(), CountingPolicy(KPolicyConfig(k=3), pipeline), pipeline)
    verifier.decoder = decoder
    rounds, handed = decoder.rounds(), 0
    async for _ in rounds:
        handed += 1
        assert decoder.policy.observed == decoder.stats.rounds == handed
        if handed == 8:
            break
    await rounds.aclose()
    assert all(observed <= committed for committed, observed in verifier.seen)
    if pipeline:  # draft = target: every block after the first two was pre-drafted, its verify out before the learning
        assert [committed - observed for committed, observed in verifier.seen[2:]] == [1] * (len(verifier.seen) - 2)


class _CountingVerifier:
    """The in-process verifier, recording the blocks it was asked to verify."""

    def __init__(self, verifier):
        self.verifier, self.blocks = verifier, []

    async def verify(self, session_id, prefix, new_tokens, block, sampling):
        self.blocks.append(list(block.tokens))
        return await self.verifier.verify(session_id, prefix, new_tokens, block, sampling)

    async def release(self, session_id):
        await self.verifier.release(session_id)


@pytest.mark.parametrize("pipeline", [False, True])
async def test_the_last_round_is_cut_to_the_end_and_nothing_is_verified_past_it(tiny_models, pipeline):
    """A request's end (max_tokens, or an EOS token) stops the rounds: the last
    block holds only the tokens still wanted, and no verify is launched after
    the round that reached the end, where it would hold the target for nothing.
    The tokens are the target alone's."""
    proposer, verifier = _services(tiny_models["target"])  # draft = target: every block is accepted whole
    prompt = [4, 8, 15, 16, 23, 42]
    expected = reference_greedy(tiny_models["target"], prompt, 14)
    for end_ids, wanted in [(frozenset(), 14), (frozenset({expected[8]}), expected.index(expected[8]) + 1)]:
        counting = _CountingVerifier(verifier)
        decoder = Decoder(proposer, counting, f"end-{pipeline}-{len(end_ids)}", Committed(prompt), ServiceView(0),
                          ServiceView(0), SamplingParams(), KPolicy(KPolicyConfig(k=4, adaptive=False), pipeline),
                          pipeline, end=len(prompt) + 14, end_ids=end_ids)
        out, rounds = [], decoder.rounds()
        async for newly in rounds:  # ends by itself at the end
            out += newly
            if len(out) > 40:  # it did not
                break
        await rounds.aclose()
        assert out[:wanted] == expected[:wanted] and wanted <= len(out) <= wanted + 4  # no round after the end's
        if not end_ids:  # the round after the prefill's: 4 + 1 tokens each; the last cut to fit 14
            assert counting.blocks == [[], expected[1:5], expected[6:10], expected[11:13]] and len(out) == 14
        assert decoder.stats.rounds == len(counting.blocks)  # each verify launched was a round that counted
