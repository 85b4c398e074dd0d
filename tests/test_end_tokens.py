"""What ends a request on a token: the model's end-of-sequence tokens (unless
ignore_eos) and the request's stop_token_ids. Each cut falls where the target
alone produced the token, which is committed and returned; with ignore_eos the
output runs on, token-identical to the target alone, to max_tokens."""
import json
import shutil

import grpc
import pytest

from orchestrator.openai_api import chat_call, completion_call
from orchestrator.openai_params import ApiError
from tests.conftest import Cluster, reference_greedy

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
N = 40


def _first_new(tokens: list[int], start: int) -> int:
    """The index of the first token at or after `start` not seen before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.fixture(scope="module")
def ending(tiny_models, tmp_path_factory):
    """(cluster, the target alone's N tokens, the eos index, the stop index):
    the tiny target, saved with one of its own greedy tokens as its end of
    sequence, and a later new token to stop at."""
    expected = reference_greedy(tiny_models["target"], PROMPT, N)  # the same weights, no end of sequence
    eos_at = _first_new(expected, 4)
    stop_at = _first_new(expected, eos_at + 2)
    path = tmp_path_factory.mktemp("eos") / "target"
    shutil.copytree(tiny_models["target"], path)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        config["eos_token_id"] = expected[eos_at]
        (path / name).write_text(json.dumps(config))
    cluster = Cluster(str(path), tiny_models["other"])
    yield cluster, expected, eos_at, stop_at
    cluster.stop()


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "sequential"])
def test_eos_ends_the_request_unless_ignored_and_stop_token_ids_end_it_too(ending, pipeline):
    cluster, expected, eos_at, stop_at = ending
    with cluster.client() as client:
        ended = client.generate(prompt_ids=PROMPT, max_tokens=N, pipeline=pipeline)
        assert (ended.finish_reason, ended.token_ids) == ("eos", expected[: eos_at + 1])
        assert ended.stop_reason is None  # vLLM's: an end of sequence is no stop token

        ignored = client.generate(prompt_ids=PROMPT, max_tokens=N, ignore_eos=True, pipeline=pipeline)
        assert (ignored.finish_reason, ignored.token_ids, ignored.stop_reason) == ("length", expected, None)

        unseen = min(set(range(127)) - set(expected[: stop_at + 1]))  # listed, never reached
        stopped = client.generate(prompt_ids=PROMPT, max_tokens=N, ignore_eos=True, pipeline=pipeline,
                                  stop_token_ids=[unseen, expected[stop_at], 127])
        assert (stopped.finish_reason, stopped.token_ids) == ("stop", expected[: stop_at + 1])
        assert stopped.stop_reason == expected[stop_at]  # the token that ended it, not the first listed
        # A stop token before the end of sequence ends it first; one never produced changes nothing.
        early = client.generate(prompt_ids=PROMPT, max_tokens=N, stop_token_ids=[expected[1]], pipeline=pipeline)
        assert (early.finish_reason, early.token_ids, early.stop_reason) == ("stop", expected[:2], expected[1])
        # Sampled, ignore_eos still runs to max_tokens.
        sampled = client.generate(prompt_ids=PROMPT, max_tokens=N, ignore_eos=True, temperature=1.0, seed=3,
                                  pipeline=pipeline)
        assert sampled.finish_reason == "length" and len(sampled.token_ids) == N


def test_stop_token_ids_outside_the_vocabulary_are_invalid(ending):
    cluster = ending[0]
    with cluster.client() as client:
        for ids, words in [([5, 128], "stop_token_ids outside [0, 128)"), (list(range(65)), "at most 64")]:
            with pytest.raises(grpc.RpcError) as caught:
                client.generate(prompt_ids=PROMPT, max_tokens=4, stop_token_ids=ids)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in caught.value.details()


def test_the_http_api_takes_vllms_ignore_eos_and_stop_token_ids():
    params = completion_call({"prompt": "x", "ignore_eos": True, "stop_token_ids": [3, 9]}).request.params
    assert params.ignore_eos and list(params.stop_token_ids) == [3, 9]
    params = chat_call({"messages": [{"role": "user", "content": "x"}]}).request.params
    assert not params.ignore_eos and not params.stop_token_ids
    for body in ({"stop_token_ids": [1, "2"]}, {"stop_token_ids": 3}, {"ignore_eos": "yes"}):
        with pytest.raises(ApiError) as caught:
            completion_call({"prompt": "x", **body})
        assert caught.value.status == 400 and caught.value.param in body
