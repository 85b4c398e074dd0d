"""Backbone: over real gRPC and Redis, greedy Tandem output equals Hugging Face
generate(do_sample=False) on the target alone, token for token (fp32)."""
import pytest

from tests.conftest import reference_greedy

PROMPTS = [[5, 17, 99, 3, 42], [7] * 3 + [64, 12, 1, 0, 127, 33], list(range(20, 60))]


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("k", [1, 4])
def test_draft_equals_target_accepts_everything(same_cluster, tiny_models, pipeline, k):
    with same_cluster.client() as client:
        for prompt in PROMPTS:
            result = client.generate(prompt_ids=prompt, max_tokens=40, num_draft_tokens=k, pipeline=pipeline)
            assert result.token_ids == reference_greedy(tiny_models["target"], prompt, 40)
            assert result.finish_reason == "length"
            stats = result.stats
            assert stats.accepted_tokens == stats.drafted_tokens > 0
            assert stats.rounds < 40  # speculation committed several tokens per round
            # the services' compute per verify and per draft step reach the client
            assert 0 < stats.verify_ms_p50 < stats.total_ms
            assert 0 < stats.draft_step_ms_p50 < stats.total_ms


@pytest.mark.parametrize("pipeline", [False, True])
def test_unrelated_draft_still_exact(random_cluster, tiny_models, pipeline):
    with random_cluster.client() as client:
        for prompt in PROMPTS:
            result = client.generate(prompt_ids=prompt, max_tokens=40, num_draft_tokens=3, pipeline=pipeline)
            assert result.token_ids == reference_greedy(tiny_models["target"], prompt, 40)
            assert result.acceptance_rate < 0.3


def test_pipelined_equals_sequential_with_adaptive_k(random_cluster, same_cluster):
    for cluster in (random_cluster, same_cluster):
        with cluster.client() as client:
            for prompt in PROMPTS:
                outputs = {
                    pipeline: client.generate(prompt_ids=prompt, max_tokens=30, pipeline=pipeline).token_ids
                    for pipeline in (False, True)
                }
                assert outputs[False] == outputs[True]
