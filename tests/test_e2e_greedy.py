"""Backbone: over real gRPC and Redis, greedy Tandem output equals Hugging Face
generate(do_sample=False) on the target alone, token for token (fp32)."""
import pytest

from tests.conftest import Cluster, build_tiny_model, reference_greedy

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
            # the services' handling beyond compute is a part of each round's overhead
            assert 0 < stats.overhead_in_services_ms_p50 < stats.overhead_ms_p50


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_request_may_fill_the_context_window_exactly(same_cluster, tiny_models, pipeline):
    """Near the end of the window the blocks, pre-drafted ones included, are cut
    to the room left (a pre-draft of k_ahead tokens once ran past it)."""
    with same_cluster.client() as client:
        for prompt_len in range(500, 509):
            prompt = [(7 * i) % 128 for i in range(prompt_len)]
            result = client.generate(prompt_ids=prompt, max_tokens=512 - prompt_len, num_draft_tokens=4,
                                     pipeline=pipeline)
            assert result.token_ids == reference_greedy(tiny_models["target"], prompt, 512 - prompt_len)
            assert result.finish_reason == "length"


def test_past_a_shorter_draft_window_rounds_go_on_without_drafts(tiny_models, tmp_path):
    """A draft whose context window (64) ends before the target's (512): rounds
    past it decode on the target alone, and the output stays exact."""
    short_draft = build_tiny_model(tmp_path / "short", seed=0, max_context=64)  # the target's weights
    cluster = Cluster(tiny_models["target"], short_draft, k=4)
    try:
        with cluster.client() as client:
            for pipeline in (False, True):
                prompt = list(range(3, 53))
                result = client.generate(prompt_ids=prompt, max_tokens=40, pipeline=pipeline)
                assert result.token_ids == reference_greedy(tiny_models["target"], prompt, 40)
                assert result.stats.drafted_tokens > 0  # drafts up to the draft's window
                assert result.stats.rounds >= 40 - (64 - len(prompt))  # one token a round past it
    finally:
        cluster.stop()


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


@pytest.mark.parametrize("draft", ["target", "other"])
def test_short_calls_run_inline_on_the_event_loop_and_stay_exact(tiny_models, draft):
    """--inline-compute on: a call of up to 16 token rows that finds the model
    thread idle runs on the server's event loop; a prefill of more stays on
    the thread (prefilled whole: chunks would leave a call of few rows).
    Greedy output is the target alone's, pipelined or not."""
    cluster = Cluster(tiny_models["target"], tiny_models[draft], adaptive=True, inline_compute="on", prefill_chunk=0)
    try:
        with cluster.client() as client:
            for prompt in PROMPTS:
                for pipeline in (False, True):
                    result = client.generate(prompt_ids=prompt, max_tokens=40, pipeline=pipeline)
                    assert result.token_ids == reference_greedy(tiny_models["target"], prompt, 40)
        for service in (cluster.target, cluster.draft):
            # PROMPTS[2] (40 tokens) is prefilled on the model thread, the rest inline
            assert service.worker.inline and 0 < service.worker.inline_calls < service.calls
    finally:
        cluster.stop()
