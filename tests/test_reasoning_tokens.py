"""Usage.reasoning_tokens (GenerationParams.reasoning; the HTTP API's
completion_tokens_details.reasoning_tokens under --reasoning-parser): the
completion's tokens up to the one in which the reasoning's end first ends,
all of them where it never comes, none where the answer does not open its
reasoning (a `start` it lacks) or the prompt closed it. The counting by halves
against a scan token by token (no model), then end to end with the tiny
character pair over real gRPC."""
import random

import grpc
import pytest

from orchestrator.text import reasoning_tokens
from tests.test_structured import cluster, models  # noqa: F401 (fixtures)


def _scan(pieces: list[str], end: str, start: str) -> int:
    """The reference: the text read as the reasoning parsers read it, then
    token by token to the first whose text holds the end."""
    text = "".join(pieces)
    if not pieces or (start and not text.lstrip().startswith(start)):
        return 0
    after = (len(text) - len(text.lstrip()) + len(start)) if start else 0
    for i in range(1, len(pieces) + 1):
        if end in "".join(pieces[:i])[after:]:
            return i
    return len(pieces)


def _decoder(pieces: list[str]):
    vocab = {piece: i for i, piece in enumerate(dict.fromkeys(pieces))}
    text_of = {i: piece for piece, i in vocab.items()}
    return [vocab[p] for p in pieces], lambda ids: "".join(text_of[i] for i in ids)


@pytest.mark.parametrize("pieces,end,start,expected", [
    (["<think>", "a", " b", "</think>", "\n\n", "c"], "</think>", "<think>", 4),
    ([" </", "think", ">\n\n{", "}"], "</think>", "", 3),  # the tag in pieces, ending inside a token
    (["x", "y", "z"], "</think>", "", 3),  # never closed: all of it is reasoning
    (["x", "</think>"], "</think>", "<think>", 0),  # qwen3 that did not open it: content alone
    (["\n ", "<think>", "a", "</think>", "b"], "</think>", "<think>", 4),  # whitespace before the start
    (["<th", "ink>", "</th", "ink>"], "</think>", "<think>", 4),
    ([], "</think>", "", 0),
])
def test_reasoning_tokens_end_with_the_token_that_ends_the_tag(pieces, end, start, expected):
    ids, decode = _decoder(pieces)
    assert reasoning_tokens(ids, decode, end, start) == expected == _scan(pieces, end, start)


def test_the_search_by_halves_agrees_with_a_scan_token_by_token():
    rng = random.Random(11)
    alphabet = ["<", "/", "t", "h", "i", "n", "k", ">", " ", "\n", "x", "</", "think", ">\n", "<think>", "</think>"]
    checked = 0
    for _ in range(400):
        pieces = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(0, 30))]
        start = rng.choice(["", "<think>"])
        if start and rng.random() < 0.5:
            pieces.insert(0, start)
        ids, decode = _decoder(pieces)
        expected = _scan(pieces, "</think>", start)
        assert reasoning_tokens(ids, decode, "</think>", start) == expected, (pieces, start)
        checked += 0 < expected < len(pieces)
    assert checked > 50  # many answers end their reasoning before their last token


# --- end to end -----------------------------------------------------------------------------

def test_reasoning_tokens_over_grpc_count_to_the_token_that_ends_the_text(cluster, models):  # noqa: F811
    """The tiny pair's tokens are characters: the reasoning is its answer up
    to the end of the first occurrence of two characters the answer writes."""
    from transformers import AutoTokenizer

    from tests.conftest import reference_greedy

    prompt, n = "A: ", 40
    tokenizer = AutoTokenizer.from_pretrained(models["target"])
    free = reference_greedy(models["target"], tokenizer.encode(prompt), n)
    at = next(i for i in range(3, n - 12) if all(32 < t < 127 for t in free[i:i + 2]))
    end = "".join(map(chr, free[at:at + 2]))
    pieces = [tokenizer.decode([t]) for t in free]
    expected = _scan(pieces, end, "")
    assert 0 < expected < n
    first = tokenizer.decode(free[:1]).lstrip()[:1]
    with cluster.client() as client:
        for pipeline in (True, False):
            result = client.generate(prompt, max_tokens=n, pipeline=pipeline, num_draft_tokens=3, ignore_eos=True,
                                     reasoning={"end": end})
            assert result.token_ids == free
            assert result.reasoning_tokens == expected
        if first:  # an answer that opens with `start` reasons; one that does not has none
            opened = client.generate(prompt, max_tokens=n, ignore_eos=True, reasoning={"end": end, "start": first})
            assert opened.reasoning_tokens == _scan(pieces, end, first)
        unopened = client.generate(prompt, max_tokens=n, ignore_eos=True, reasoning={"end": end, "start": "\x01"})
        assert unopened.reasoning_tokens == 0
        never = client.generate(prompt, max_tokens=n, ignore_eos=True, reasoning={"end": "\x01\x02"})
        assert never.reasoning_tokens == n == never.completion_tokens
        # A prompt that ends with the reasoning's end and whitespace closed it: none, and the first delta says so.
        closed_prompt = prompt + "</think>\n"
        events = list(client.generate_stream(closed_prompt, max_tokens=8, ignore_eos=True,
                                             reasoning={"end": "</think>"}))
        assert events[0].delta.after_in_prompt and events[-1].final.usage.reasoning_tokens == 0
        open_prompt = list(client.generate_stream(prompt + "</think> x", max_tokens=8, ignore_eos=True,
                                                  reasoning={"end": "</think>"}))
        assert not open_prompt[0].delta.after_in_prompt and open_prompt[-1].final.usage.reasoning_tokens == 8
        # Without `reasoning`, nothing is counted.
        assert client.generate(prompt, max_tokens=8).reasoning_tokens == 0


@pytest.mark.parametrize("reasoning,words", [({"end": ""}, "reasoning.end"), ({"end": "x" * 65}, "reasoning.end"),
                                             ({"end": "</think>", "start": "y" * 65}, "reasoning.start")])
def test_a_bad_reasoning_tag_is_invalid(cluster, reasoning, words):  # noqa: F811
    with cluster.client() as client, pytest.raises(grpc.RpcError) as err:
        client.generate("A: ", max_tokens=4, reasoning=reasoning)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
