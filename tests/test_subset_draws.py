"""A reduced draft head's tokens drawn over its subset alone (draw_subset): the
same tokens, probabilities and distributions as drawn over its logits spread
across the whole vocabulary, and end to end the sampled output keeps the
target's distribution while the draft's is zero off its subset."""
import threading

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from draft_service.cheap import ReducedHead
from draft_service.drafters import ProposeCall, draw, draw_subset
from draft_service.model_drafter import ModelDrafter
from draft_service.server import DraftOptions
from tandem import fingerprint
from tandem.distributions import (SubsetDist, decode_distribution, decode_distributions, encode_distribution,
                                  encode_distributions)
from tandem.sampling import SamplingParams
from tests.conftest import Cluster, reference_greedy
from tests.test_batching import _drafter

VOCAB, HIDDEN = 1000, 16
SAMPLINGS = [SamplingParams(), SamplingParams(temperature=0.7, seed=11), SamplingParams(temperature=1.0, seed=5, top_k=20),
             SamplingParams(temperature=0.9, seed=3, top_p=0.8), SamplingParams(temperature=1.2, seed=9, min_p=0.05)]


def _head(ids: list[int]) -> tuple[ReducedHead, torch.Tensor]:
    weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))
    return ReducedHead(weight, torch.tensor(ids)), weight


def test_the_head_sorts_its_ids_and_scores_each_with_its_own_row():
    head, weight = _head([500, 3, 999, 42, 3])  # unsorted, one twice
    assert head.token_ids.tolist() == [3, 42, 500, 999]
    assert np.frombuffer(head.ids_i32, "<i4").tolist() == [3, 42, 500, 999]
    hidden = torch.randn(2, HIDDEN)
    sub, full = head.subset_rows(hidden), head.rows(hidden)
    torch.testing.assert_close(sub, hidden @ weight[[3, 42, 500, 999]].T)
    assert full.shape == (2, VOCAB) and torch.equal(full[:, head.token_ids], sub)
    assert int(full.isinf().sum()) == 2 * (VOCAB - 4)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t0.7", "top_k", "top_p", "min_p"])
def test_a_draw_over_the_subset_is_the_draw_over_the_whole_vocabulary(sampling):
    ids = sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:300].tolist())
    head, _ = _head(ids)
    hiddens = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(2)) * 3
    for position, hidden in enumerate(hiddens):
        sub = head.subset_rows(hidden[None])[0]
        full = head.scatter(sub[None])[0]
        for first, guess in ((True, True), (False, True), (False, False)):
            call = ProposeCall("s", 0, 0, [1], 4, sampling, True, first_is_bonus_guess=guess)
            token, prob, dist = draw_subset(sub, head, call, position, first)
            expected_token, expected_prob, expected_dist = draw(full, call, position, first)
            assert token == expected_token and token in ids
            if sampling.greedy:
                assert prob is None and dist is None and expected_prob is None
                continue
            assert prob == pytest.approx(expected_prob, rel=1e-5)
            assert isinstance(dist, SubsetDist) and dist.vocab_size == VOCAB
            message = encode_distribution(dist)  # over the subset, or over its non-zero entries where fewer
            nonzero = int((expected_dist > 0).sum())
            assert len(message.sparse_ids_i32) == len(message.sparse_probs_f32) == \
                4 * (len(ids) if 2 * nonzero >= len(ids) else nonzero)
            torch.testing.assert_close(decode_distribution(message), expected_dist, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("sampling", SAMPLINGS + [SamplingParams(temperature=0.8, seed=4, logit_bias=((7, 2.0),))],
                         ids=["greedy", "t0.7", "top_k", "top_p", "min_p", "biased"])
def test_a_drafter_drafts_over_the_subset_what_it_drafts_over_the_vocabulary(tiny_models, monkeypatch, sampling):
    """A block drafted over the reduced head's subset alone equals the one
    drafted over its logits spread across the vocabulary (the path before
    it, and still the path of a call that adjusts its logits: "biased"),
    distributions included; the bonus guess first, as a pre-draft drafts it."""
    history = [5, 9, 2, 6, 5, 3, 5]
    call = ProposeCall("s", 3, fingerprint.of(history[:3]), history[3:], 5, sampling, True, True, alternatives=True)
    proposals = []
    for subset in (True, False):
        drafter = _drafter(tiny_models, vocab_subset=40)
        if not subset:
            monkeypatch.setattr(drafter, "subset_for", lambda call: None)
        elif not sampling.adjusts:
            assert drafter.subset_for(call) is drafter.head
        drafter.store.checkout("s", 0, 0)[0].append(history[:3])
        proposals.append(drafter.propose(call, threading.Event()))
    fast, spread = proposals
    assert fast.tokens == spread.tokens and len(fast.tokens) == 5
    assert fast.alternatives == spread.alternatives
    assert fast.token_probs == pytest.approx(spread.token_probs, rel=1e-5)
    assert len(fast.dists) == len(spread.dists) == (0 if sampling.greedy else 5)
    kinds = {type(d) for d in fast.dists}
    assert kinds <= ({torch.Tensor} if sampling.adjusts else {SubsetDist})
    if sampling.greedy:
        return
    messages, shared = encode_distributions(fast.dists)  # as the draft service sends the block
    # A subset's ids go once, beside its rows; a row with non-zero entries for
    # under half of them (top-k, top-p, min_p) goes over those alone.
    if not sampling.adjusts:
        for message, theirs in zip(messages, spread.dists):
            nonzero = int((theirs > 0).sum())
            assert message.shared_ids == (2 * nonzero >= 40)
            assert len(message.sparse_probs_f32) == 4 * (40 if message.shared_ids else nonzero)
        assert len(shared) == (4 * 40 if any(m.shared_ids for m in messages) else 0)
    else:
        assert shared == b"" and not any(m.shared_ids for m in messages)
    torch.testing.assert_close(decode_distributions(messages, shared), torch.stack(spread.dists), rtol=1e-5, atol=1e-7)


def test_a_doubted_token_is_found_among_the_subset_s_logits():
    """min_confidence over the subset's logits weighs the token at its own
    place there (not at its id), as over the logits spread across the vocabulary."""
    from types import SimpleNamespace

    head, _ = _head([500, 3, 999, 42])
    sub = torch.tensor([0.0, 4.0, -1.0, 1.0])  # 3, 42, 500, 999: 42 likely, 500 not
    full = head.scatter(sub[None])[0]
    drafter = SimpleNamespace(min_confidence=0.5)
    call = ProposeCall("s", 0, 0, [1], 4, SamplingParams(), False, False)
    for token, doubted in ((42, False), (500, True), (3, True)):
        assert ModelDrafter._doubts(drafter, sub, token, call, 1, head) is doubted
        assert ModelDrafter._doubts(drafter, full, token, call, 1) is doubted


def test_sampled_tokens_keep_the_target_distribution_with_a_reduced_draft_head(tiny_models):
    """End to end, temperature 0.7 with a draft that is the target scoring 24
    of its 128 tokens (its distribution zero elsewhere, sent over its subset):
    the second generated token's frequencies over many seeds match its exact
    marginal under the target. There q is p renormalized over the subset, so
    a drafted token is accepted with probability p(subset) and every
    correction is drawn off the subset (the residual is p there): the tokens
    off it come from the residual draws, those on it from the accept rule."""
    from scipy.stats import chisquare

    prompt, n, temperature = [10, 20, 30, 40, 50, 60, 10, 20], 1200, 0.7
    model = AutoModelForCausalLM.from_pretrained(tiny_models["target"], dtype=torch.float32).eval()
    with torch.inference_mode():
        first = (model(torch.tensor([prompt])).logits[0, -1] / temperature).softmax(-1)
        batch = torch.tensor([prompt + [x] for x in range(first.shape[0])])
        seconds = (model(batch).logits[:, -1] / temperature).softmax(-1)
    exact = (first[:, None] * seconds).sum(0).double().numpy()
    exact /= exact.sum()
    counts = np.zeros(len(exact))
    accepted = 0
    cluster = Cluster(tiny_models["target"], tiny_models["target"], draft_options=DraftOptions(vocab_subset=24))
    try:
        with cluster.client() as client:
            assert "vocab=24" in client.server_info().draft_backend
            for seed in range(n):
                # Three tokens: the first from the prefill's round, the second drafted
                # (with two, the second round would have no room for a draft token).
                result = client.generate(prompt_ids=prompt, max_tokens=3, temperature=temperature, seed=seed,
                                         num_draft_tokens=2)
                counts[result.token_ids[1]] += 1
                accepted += result.stats.accepted_tokens
    finally:
        cluster.stop()
    assert 0 < accepted < n  # both the accept rule and the residual draws are tested
    expected = exact * n
    big = expected >= 5  # the rest in one bin
    observed = np.append(counts[big], counts[~big].sum())
    assert chisquare(observed, np.append(expected[big], expected[~big].sum())).pvalue > 1e-3
    assert abs(counts[24:].sum() / n - exact[24:].sum()) < 0.05


def test_an_orchestrator_that_drops_the_shared_ids_fails_sampled_requests_loudly(tiny_models, monkeypatch):
    """An orchestrator older than its services (wire version 2) forwards the
    rows of a reduced head's block without the ids they share: the target
    refuses them, so a sampled turn fails with words rather than sampling from
    a wrong residual; the session keeps what it committed, and its next,
    greedy turn (no distribution sent) goes on from there exactly."""
    import dataclasses

    import grpc

    from orchestrator.backends import GrpcProposer

    propose = GrpcProposer.propose

    async def without_ids(self, *args, **kwargs):
        return dataclasses.replace(await propose(self, *args, **kwargs), distribution_ids=b"")

    monkeypatch.setattr(GrpcProposer, "propose", without_ids)
    turns = [[10, 20, 30, 40, 50, 60, 10, 20], [7, 8, 9], [11, 12]]
    cluster = Cluster(tiny_models["target"], tiny_models["target"], draft_options=DraftOptions(vocab_subset=24))
    try:
        with cluster.client() as client:
            session = client.create_session()
            first = client.chat(session, message_ids=turns[0], max_tokens=6, temperature=0.0)
            with pytest.raises(grpc.RpcError) as refused:
                client.chat(session, message_ids=turns[1], max_tokens=6, temperature=0.7, seed=1)
            assert refused.value.code() == grpc.StatusCode.INTERNAL
            assert "no ids are shared" in refused.value.details()
            kept = cluster.run(cluster.orchestrator.store.load("default", session)).tokens
            assert kept[:len(turns[0]) + 6] == turns[0] + first.token_ids  # the first turn is whole
            third = client.chat(session, message_ids=turns[2], max_tokens=6, temperature=0.0)
            record = cluster.run(cluster.orchestrator.store.load("default", session))
            client.delete_session(session)
    finally:
        cluster.stop()
    assert first.token_ids == reference_greedy(tiny_models["target"], turns[0], 6)
    assert third.token_ids == reference_greedy(tiny_models["target"], kept + turns[2], 6)
    assert record.tokens == kept + turns[2] + third.token_ids
