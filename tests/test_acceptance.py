"""The acceptance rule as a pure function: hand-built distributions, no model."""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tandem import rng
from tandem.acceptance import Verdict, verify_greedy, verify_greedy_tree, verify_sampled
from tandem.distributions import logits_to_probs, sample
from tandem.sampling import SamplingParams


def test_greedy_accepts_matching_prefix_then_corrects():
    assert verify_greedy([3, 5, 7], [3, 5, 1, 9]) == Verdict(2, 1)


def test_greedy_all_accepted_gives_bonus():
    assert verify_greedy([3, 5], [3, 5, 8]) == Verdict(2, 8)


def test_greedy_tree_takes_the_alternative_that_is_the_correction():
    # Draft 3 5 7; the target keeps 3 5 and wants 1 where the draft put 7. An
    # alternative 1 at position 2 was verified: it is kept, and the target's
    # token after it (4) is committed too.
    alternatives = [(0, 2), (1, 6), (2, 1)]
    verdict = verify_greedy_tree([3, 5, 7], [3, 5, 1, 9], alternatives, [11, 12, 4])
    assert verdict == Verdict(2, 1, taken=2, more_tokens=(4,))


def test_greedy_tree_ignores_alternatives_elsewhere_or_wrong():
    # The correction at position 1 is 8: the alternative there (6) is not it, and
    # the one at position 0 (2) lies before the rejection.
    assert verify_greedy_tree([3, 5, 7], [3, 8, 1, 9], [(0, 2), (1, 6)], [11, 12]) == Verdict(1, 8)
    # The correction's token (1) as an alternative at another position: not taken.
    assert verify_greedy_tree([3, 5, 7], [3, 1, 1, 9], [(2, 1)], [4]) == Verdict(1, 1)
    # All accepted: the bonus, whatever the alternatives.
    assert verify_greedy_tree([3, 5], [3, 5, 8], [(0, 8), (1, 8)], [1, 2]) == Verdict(2, 8)
    # Rejected at 0, the alternative there is the correction.
    assert verify_greedy_tree([3, 5], [2, 5, 8], [(0, 2)], [7]) == Verdict(0, 2, taken=0, more_tokens=(7,))


def test_greedy_first_rejected_and_empty_block():
    assert verify_greedy([4], [2, 9]) == Verdict(0, 2)
    assert verify_greedy([], [6]) == Verdict(0, 6)


TARGET = torch.tensor([0.05, 0.40, 0.05, 0.30, 0.15, 0.05], dtype=torch.float64)
DRAFT = torch.tensor([0.30, 0.10, 0.30, 0.10, 0.10, 0.10], dtype=torch.float64)


def _first_token(draft_token: int, u_accept: float, u_target: float, rule=verify_sampled) -> int:
    target_probs = torch.stack([TARGET, TARGET])  # [k+1, vocab], k = 1
    verdict = rule([draft_token], [float(DRAFT[draft_token])], DRAFT[None], target_probs, [u_accept], [u_target, u_target])
    return draft_token if verdict.accepted else verdict.next_token


def _expected(counts, probs):
    probs = np.asarray(probs, dtype=np.float64)
    return probs / probs.sum() * counts.sum()


def _sampled_counts(rule, n=20000, seed=7):
    gen = np.random.default_rng(seed)
    counts = np.zeros(len(TARGET))
    for _ in range(n):
        draft_token = int(gen.choice(len(DRAFT), p=DRAFT.numpy() / DRAFT.numpy().sum()))
        counts[_first_token(draft_token, gen.random(), gen.random(), rule)] += 1
    return counts


def test_sampled_tokens_follow_the_target_distribution():
    counts = _sampled_counts(verify_sampled)
    assert chisquare(counts, _expected(counts, TARGET.numpy())).pvalue > 1e-3
    tv = 0.5 * np.abs(counts / counts.sum() - TARGET.numpy()).sum()
    assert tv < 0.02


def test_the_distribution_test_catches_a_wrong_rule():
    def accept_everything(draft_tokens, *args):
        return type(verify_sampled([], [], None, TARGET[None], [], [0.5]))(len(draft_tokens), 0)

    counts = _sampled_counts(accept_everything, n=5000)
    assert chisquare(counts, _expected(counts, TARGET.numpy())).pvalue < 1e-6


def test_two_draft_tokens_second_position_distribution():
    """With k = 2 and draft = target, both positions keep the target's marginals."""
    gen = np.random.default_rng(3)
    counts = np.zeros(len(TARGET))
    probs = TARGET.numpy() / TARGET.numpy().sum()
    for _ in range(8000):
        a, b = (int(gen.choice(6, p=probs)) for _ in range(2))
        verdict = verify_sampled([a, b], [float(TARGET[a]), float(TARGET[b])], torch.stack([TARGET, TARGET]),
                                 torch.stack([TARGET] * 3), [gen.random(), gen.random()], [gen.random()] * 3)
        assert verdict.accepted == 2  # p/q = 1 always passes
        counts[b] += 1
    assert chisquare(counts, _expected(counts, probs)).pvalue > 1e-3


def test_a_round_without_draft_tokens_samples_the_target_distribution():
    """k = 0, as in a round on the target alone while the draft service is down:
    the one token a round commits is drawn from the target's distribution."""
    gen = np.random.default_rng(11)
    counts = np.zeros(len(TARGET))
    for _ in range(20000):
        verdict = verify_sampled([], [], None, TARGET[None], [], [gen.random()])
        assert verdict.accepted == 0
        counts[verdict.next_token] += 1
    assert chisquare(counts, _expected(counts, TARGET.numpy())).pvalue > 1e-3
    assert 0.5 * np.abs(counts / counts.sum() - TARGET.numpy()).sum() < 0.02


def test_seeded_draws_are_deterministic_per_position():
    assert rng.uniform(42, rng.ACCEPT, 10) == rng.uniform(42, rng.ACCEPT, 10)
    assert rng.uniform(42, rng.ACCEPT, 10) != rng.uniform(42, rng.ACCEPT, 11)
    assert rng.uniform(42, rng.ACCEPT, 10) != rng.uniform(42, rng.TARGET, 10)
    assert rng.uniform(42, rng.ACCEPT, 10) != rng.uniform(43, rng.ACCEPT, 10)
    verdicts = {
        verify_sampled([2], [0.3], DRAFT[None], torch.stack([TARGET, TARGET]),
                       rng.uniforms(9, rng.ACCEPT, 0, 1), rng.uniforms(9, rng.TARGET, 0, 2))
        for _ in range(3)
    }
    assert len(verdicts) == 1


def test_rejected_correction_never_repeats_the_rejected_token():
    for u in np.linspace(0.01, 0.99, 25):
        verdict = verify_sampled([0], [0.3], DRAFT[None], torch.stack([TARGET, TARGET]), [0.99], [float(u), 0.5])
        assert verdict.accepted == 0 and verdict.next_token != 0  # q(0) > p(0): residual is zero there


def test_logits_processing_top_k_top_p_and_sample():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))[0]
    assert probs[2] == 0 and probs[3] == 0 and abs(float(probs.sum()) - 1) < 1e-6
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))[0]
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert sample(torch.tensor([0.0, 0.5, 0.0, 0.5]), 0.0) == 1
    assert sample(torch.tensor([0.0, 0.5, 0.0, 0.5]), 0.99) == 3


def _top_p_by_whole_sort(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """top-p's definition, each row sorted whole: a token goes when the mass
    of the tokens more likely than it already reaches top_p."""
    probs = scores.softmax(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop = torch.empty_like(probs, dtype=torch.bool)
    return drop.scatter_(-1, order, (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p)


@pytest.mark.parametrize("vocab", [151_936, 32_790, 128])
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_top_p_over_its_candidates_keeps_what_a_whole_sort_keeps(vocab, top_p):
    """top-p looks for its cut among a row's 1024 most likely tokens first,
    and sorts the whole row only where their mass stays under top_p: peaked
    rows (the first path), flat ones (the second) and both in one call keep
    exactly the tokens that sorting each whole row keeps."""
    from tandem.distributions import TOP_P_CANDIDATES, _beyond_top_p

    generator = torch.Generator().manual_seed(vocab + int(100 * top_p))
    peaked = torch.randn(3, vocab, generator=generator) * 8  # a few tokens hold most of the mass
    flat = torch.randn(3, vocab, generator=generator) * 0.3
    scores = torch.cat([peaked, flat])
    paths = set()
    for row in scores:
        kept_mass = row.softmax(-1).topk(min(TOP_P_CANDIDATES, vocab)).values.sum()
        paths.add(bool(kept_mass >= top_p))
    assert paths == ({True} if vocab <= TOP_P_CANDIDATES else {True, False})  # both paths, where there are two
    expected = _top_p_by_whole_sort(scores, top_p)
    assert torch.equal(_beyond_top_p(scores, top_p), expected)
    for row in range(scores.shape[0]):  # each row alone, as a draft step asks
        assert torch.equal(_beyond_top_p(scores[row:row + 1], top_p), expected[row:row + 1])
    kept = logits_to_probs(scores, SamplingParams(temperature=1.0, top_p=top_p)) > 0
    assert torch.equal(kept, ~expected) and bool(kept[torch.arange(6), scores.argmax(-1)].all())


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(temperature=float("inf")), dict(temperature=float("nan")),
                                 dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)])
def test_sampling_params_reject_bad_values(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_a_vanishing_temperature_decodes_greedily():
    """Float32 logits divided by 1e-39 overflow and their softmax is NaN; such
    temperatures take the greedy path instead (argmax, as their limit)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    assert not torch.isfinite(torch.softmax(logits / 1e-39, dim=-1)).all()
    assert SamplingParams(temperature=1e-39).greedy and SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert logits_to_probs(logits, SamplingParams(temperature=1e-4))[0].tolist() == [1.0, 0.0, 0.0, 0.0]
