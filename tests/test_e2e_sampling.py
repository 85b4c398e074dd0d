"""Sampled generation over real gRPC: seeded runs are reproducible, and the same
seed gives the same tokens with the pipeline on or off."""
import pytest

from tests.conftest import TINY_VOCAB

PROMPT = [9, 8, 7, 6, 5, 4]


@pytest.mark.parametrize("cluster_name", ["random_cluster", "same_cluster"])
def test_seeded_sampling_reproducible_and_pipeline_invariant(cluster_name, request):
    cluster = request.getfixturevalue(cluster_name)
    sampled = dict(max_tokens=30, temperature=1.0, top_k=40, top_p=0.95, num_draft_tokens=3)
    with cluster.client() as client:
        first = client.generate(prompt_ids=PROMPT, seed=1234, pipeline=False, **sampled)
        again = client.generate(prompt_ids=PROMPT, seed=1234, pipeline=False, **sampled)
        piped = client.generate(prompt_ids=PROMPT, seed=1234, pipeline=True, **sampled)
        other = client.generate(prompt_ids=PROMPT, seed=999, pipeline=False, **sampled)
    assert len(first.token_ids) == 30
    assert first.token_ids == again.token_ids == piped.token_ids
    assert first.token_ids != other.token_ids
    assert first.stats.seed == 1234


def test_sampling_with_draft_equal_target_accepts_everything(same_cluster):
    """p/q = 1 for every draft token: the rule must accept all of them."""
    with same_cluster.client() as client:
        result = client.generate(prompt_ids=PROMPT, max_tokens=24, temperature=0.8, seed=5, num_draft_tokens=4)
        greedy = client.generate(prompt_ids=PROMPT, max_tokens=24, num_draft_tokens=4)
    stats = result.stats
    assert stats.accepted_tokens == stats.drafted_tokens > 0
    # Each drafted token's distribution went to the target, dense here (every
    # token has some probability): 4 bytes an entry and a few of framing.
    assert 4 * TINY_VOCAB * stats.drafted_tokens <= stats.draft_distribution_bytes
    assert stats.draft_distribution_bytes <= (4 * TINY_VOCAB + 16) * stats.drafted_tokens
    assert greedy.stats.drafted_tokens > 0 and greedy.stats.draft_distribution_bytes == 0  # token ids only


def test_a_seed_fixes_the_tokens_under_an_adaptive_server(tiny_models):
    """The server adapts k to timings, and the tokens of a seed depend on where
    the blocks end: a seeded sampled request drafts the server's fixed k, so it
    gives the same tokens every time, pipelined or not."""
    from tests.conftest import Cluster

    cluster = Cluster(tiny_models["target"], tiny_models["target"], k=4, adaptive=True)
    sampled = dict(max_tokens=30, temperature=1.0, seed=77)
    try:
        with cluster.client() as client:
            for _ in range(2):  # the policy learns the costs, and k moves off 4
                assert client.generate(prompt_ids=PROMPT, max_tokens=30).stats.mean_k
            runs = [client.generate(prompt_ids=PROMPT, pipeline=pipeline, **sampled)
                    for pipeline in (False, True, False, True)]
            fixed = client.generate(prompt_ids=PROMPT, pipeline=False, num_draft_tokens=4, **sampled)
    finally:
        cluster.stop()
    assert all(run.token_ids == fixed.token_ids for run in runs)
    # k = 4 in every round but the first, which prefills the prompt and decodes one token on the target,
    # and the last, whose block may be cut to the tokens still wanted (max_tokens).
    for run in runs:
        per_k = [*run.stats.rounds_per_k, 0, 0, 0, 0, 0][:5]
        assert per_k[0] == 1 and sum(per_k[1:4]) <= 1 and sum(per_k) == run.stats.rounds, per_k
