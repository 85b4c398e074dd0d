"""Log probabilities (GenerationParams.logprobs): each generated token's, and the
likeliest tokens' at its position, are the target model's own, as the target
alone scores the same sequence in one forward, whatever rounds, blocks,
alternatives or pipelining committed the token."""
import functools

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.logprobs import MAX_TOP_LOGPROBS, token_logprobs
from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc
from tests.conftest import Cluster, reference_greedy

PROMPTS = ([3, 1, 4, 1, 5, 9, 2, 6], [10, 20, 30, 40, 50, 60, 10, 20], list(range(5, 45, 2)))
ATOL = 2e-3  # the services' CPU kernels against Hugging Face's eager forward, float32


@functools.lru_cache(maxsize=2)
def _target(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_logprobs(model_dir: str, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """[len(completion), vocab]: the target alone's log-softmax of its raw
    logits at each completion token's position, in one forward."""
    with torch.inference_mode():
        logits = _target(model_dir)(torch.tensor([prompt + completion])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) + len(completion) - 1].float(), dim=-1)


def assert_match(result, reference: torch.Tensor, top: int) -> None:
    """Each token's reported log probability and top tokens are the reference's."""
    assert [lp.token_id for lp in result.logprobs] == result.token_ids
    for i, (lp, row) in enumerate(zip(result.logprobs, reference)):
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=ATOL), i
        assert (row > lp.logprob + ATOL).sum() + 1 <= lp.rank <= (row > lp.logprob - ATOL).sum() + 1, i
        assert len(lp.top_logprobs) == top
        values = [t.logprob for t in lp.top_logprobs]
        assert values == sorted(values, reverse=True)
        # The k likeliest by value (which of two near-tied tokens comes first may differ).
        torch.testing.assert_close(torch.tensor(values), row.topk(top).values, atol=ATOL, rtol=0)
        for t in lp.top_logprobs:
            assert t.logprob == pytest.approx(row[t.token_id].item(), abs=ATOL)


def test_token_logprobs_are_the_log_softmax_and_its_likeliest():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 4
    tokens = [7, 0, 49]
    got = token_logprobs(logits, tokens, top=4)
    expected = torch.log_softmax(logits, dim=-1)
    for lp, row, token in zip(got, expected, tokens):
        assert lp.logprob == pytest.approx(row[token].item(), abs=1e-6)
        assert list(lp.top_tokens) == row.topk(4).indices.tolist()
        torch.testing.assert_close(torch.tensor(lp.top_logprobs), row.topk(4).values)
    assert all(lp.top_tokens == () for lp in token_logprobs(logits, tokens))  # top 0: the token's own only
    assert token_logprobs(logits[:0], []) == ()
    # The rank: 1 + how many tokens are likelier; the likeliest is 1, and tied tokens share the best rank.
    assert [lp.rank for lp in got] == [1 + (row > row[t]).sum().item() for row, t in zip(logits, tokens)]
    assert [lp.rank for lp in token_logprobs(logits, tokens)] == [lp.rank for lp in got]
    tied = torch.tensor([[0.0, 2.0, 2.0, 1.0]])
    assert [token_logprobs(tied, [t])[0].rank for t in range(4)] == [4, 1, 1, 3]


@pytest.fixture(scope="module")
def cluster(tiny_models, near_draft):
    """A draft close to the target: rounds accept blocks and take alternatives
    (--tree-width 4), so committed tokens come from every kind of row of a verify."""
    cluster = Cluster(tiny_models["target"], near_draft, tree_width=4, target_graphs="off",
                      target_batch=1)  # Hugging Face's forward: the lean one verifies no trees
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "sequential"])
@pytest.mark.parametrize("cluster_name", ["cluster", "same_cluster"], ids=["near-draft", "draft-is-target"])
def test_greedy_logprobs_equal_the_target_alone(request, tiny_models, cluster_name, pipeline):
    """With a draft near the target, rounds commit accepted tokens, corrections
    and alternatives with the target's token after them; with the target as
    its own draft, whole blocks and their bonus tokens."""
    cluster, target = request.getfixturevalue(cluster_name), tiny_models["target"]
    accepted = alternatives = tokens = 0
    with cluster.client() as client:
        for prompt in PROMPTS:
            result = client.generate(prompt_ids=prompt, max_tokens=24, logprobs=True, top_logprobs=5,
                                     pipeline=pipeline, num_draft_tokens=4)
            assert result.token_ids == reference_greedy(target, prompt, 24)
            assert_match(result, reference_logprobs(target, prompt, result.token_ids), top=5)
            # Greedy: each token is the likeliest at its position.
            assert all(lp.top_logprobs[0].logprob == pytest.approx(lp.logprob, abs=1e-6) for lp in result.logprobs)
            accepted += result.stats.accepted_tokens
            alternatives += result.stats.alternative_hits
            tokens += len(result.token_ids)
    if cluster_name == "cluster":
        assert accepted > 0 and alternatives > 0
    else:
        assert accepted > tokens / 2


def test_a_chat_turns_logprobs_are_the_target_alones_over_the_whole_history(cluster, tiny_models):
    """The second turn's first verify takes in only the new turn: its tokens'
    log probabilities still condition on everything before."""
    target = tiny_models["target"]
    with cluster.client() as client:
        session = client.create_session()
        first = client.chat(session, message_ids=PROMPTS[0], max_tokens=12, logprobs=True, top_logprobs=2)
        second = client.chat(session, message_ids=[7, 7, 7], max_tokens=12, logprobs=True, top_logprobs=2)
        client.delete_session(session)
    assert_match(first, reference_logprobs(target, PROMPTS[0], first.token_ids), top=2)
    history = PROMPTS[0] + first.token_ids + [7, 7, 7]
    assert second.token_ids == reference_greedy(target, history, 12)
    assert second.stats.cache_misses == 0 and second.stats.target_prefill_tokens < len(history)  # the caches reused
    assert_match(second, reference_logprobs(target, history, second.token_ids), top=2)


def test_sampled_logprobs_are_the_models_own_and_change_no_token(cluster, tiny_models):
    """Under sampling the reported log probability is the raw model's, before
    temperature (as vLLM reports it), and asking for it draws the same tokens."""
    target, prompt = tiny_models["target"], PROMPTS[1]
    params = dict(max_tokens=32, temperature=0.7, top_p=0.95, seed=99)
    with cluster.client() as client:
        plain = client.generate(prompt_ids=prompt, **params)
        result = client.generate(prompt_ids=prompt, logprobs=True, **params)
    assert result.token_ids == plain.token_ids and len(result.token_ids) == 32
    assert not plain.logprobs
    reference = reference_logprobs(target, prompt, result.token_ids)
    assert_match(result, reference, top=0)
    with torch.inference_mode():
        logits = _target(target)(torch.tensor([prompt + result.token_ids])).logits[0]
    tempered = torch.log_softmax(logits[len(prompt) - 1: -1] / 0.7, dim=-1)
    gaps = [abs(lp.logprob - tempered[i, lp.token_id].item()) for i, lp in enumerate(result.logprobs)]
    assert max(gaps) > 0.05  # not the tempered distribution's


def test_bad_logprob_requests_are_invalid_argument(cluster):
    with cluster.client() as client:
        for params, words in [(dict(top_logprobs=3), "needs logprobs"),
                              (dict(logprobs=True, top_logprobs=MAX_TOP_LOGPROBS + 1), "top_logprobs"),
                              (dict(logprobs=True, top_logprobs=-1), "top_logprobs")]:
            with pytest.raises(grpc.RpcError) as caught:
                client.generate(prompt_ids=PROMPTS[0], max_tokens=4, **params)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, params
            assert words in caught.value.details()
        assert client.generate(prompt_ids=PROMPTS[0], max_tokens=4).completion_tokens == 4  # still serving
    with grpc.insecure_channel(cluster.target_address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        request = target_pb2.VerifyRequest(session_id="logprobs-bad", prefix=common_pb2.PrefixRef(),
                                           new_tokens=[1, 2, 3], return_logprobs=True,
                                           top_logprobs=MAX_TOP_LOGPROBS + 1)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Verify(request, timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_logprobs" in caught.value.details()


def test_prompt_logprobs_are_the_target_alones_and_need_the_whole_prompt_run(cluster, tiny_models):
    """A prompt longer than the target's chunk of scored rows comes back with
    each token's log probability after the first, as one forward of the target
    alone gives it; the completion is unchanged. A second request with the same
    prompt runs it whole again (a parked session's prefix has no rows to score)."""
    from target_service.verifier import PROMPT_CHUNK

    target = tiny_models["target"]
    prompt = [(7 * i + i * i) % 128 for i in range(2 * PROMPT_CHUNK + 45)]
    reference = reference_logprobs(target, prompt[:1], prompt[1:])
    expected = reference_greedy(target, prompt, 8)
    with cluster.client() as client:
        for _ in range(2):
            result = client.generate(prompt_ids=prompt, max_tokens=8, prompt_logprobs=3, logprobs=True)
            assert result.token_ids == expected and result.cached_prompt_tokens == 0
            assert list(result.prompt.token_ids) == prompt
            scored = result.prompt.logprobs
            assert [lp.token_id for lp in scored] == prompt[1:]
            values = torch.tensor([lp.logprob for lp in scored])
            torch.testing.assert_close(values, reference[torch.arange(len(prompt) - 1), prompt[1:]],
                                       atol=ATOL, rtol=0)
            for lp, row in zip(scored, reference):
                assert [t.logprob for t in lp.top_logprobs] == pytest.approx(row.topk(3).values.tolist(), abs=ATOL)
                # The rank the target reports: 1 + the tokens likelier than it (within the kernels' tolerance).
                assert (row > lp.logprob + ATOL).sum() + 1 <= lp.rank <= (row > lp.logprob - ATOL).sum() + 1
            assert_match(result, reference_logprobs(target, prompt, expected), top=0)
        echoed = client.generate(prompt_ids=prompt, max_tokens=8, echo=True)  # reuses the prefix: no scores
        assert list(echoed.prompt.token_ids) == prompt and not echoed.prompt.logprobs
        assert echoed.cached_prompt_tokens > PROMPT_CHUNK  # so the scored requests above chose not to
        assert echoed.token_ids == expected and not client.generate(prompt_ids=prompt, max_tokens=2).prompt
        for params in (dict(prompt_logprobs=MAX_TOP_LOGPROBS + 1), dict(prompt_logprobs=-1)):
            with pytest.raises(grpc.RpcError) as caught:
                client.generate(prompt_ids=prompt, max_tokens=2, **params)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in caught.value.details()
        session = client.create_session()
        with pytest.raises(grpc.RpcError) as caught:
            client.chat(session, message_ids=[1, 2, 3], max_tokens=2, echo=True)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Generate's" in caught.value.details()
        assert client.chat(session, message_ids=[1, 2, 3], max_tokens=2).completion_tokens == 2
        client.delete_session(session)
