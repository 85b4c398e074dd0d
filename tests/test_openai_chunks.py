"""The HTTP API's answers built from Generate's events, without a model: tool
calls streamed as they complete, and nothing of the text, its token ids or its
log probabilities lost where the stream holds text back."""
import json

import pytest

from orchestrator import tool_parsers
from orchestrator.openai_api import chat_call
from orchestrator.openai_response import Answer, Chunks, response
from tandem.v1 import tandem_pb2

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "Weather in Oslo and Paris, and the time?"}]
LISTED = ('[{"name": "get_weather", "parameters": {"city": "Oslo", "days": [1, 2]}},\n'
          ' {"name": "get_weather", "parameters": {"city": "Paris \\"Ville\\" {x}"}}, '
          '{"name": "get_time", "parameters": {}}]')
CALLS = [("get_weather", {"city": "Oslo", "days": [1, 2]}), ("get_weather", {"city": 'Paris "Ville" {x}'}),
         ("get_time", {})]


def _named(calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_a_listed_call_is_read_once_its_object_closes_and_never_before():
    seen = 0
    for cut in range(len(LISTED) + 1):
        calls, end, closed = tool_parsers.listed_calls(LISTED[:cut])
        assert _named(calls) == CALLS[:len(calls)]
        assert len(calls) >= seen  # a call once read stays read
        seen = len(calls)
        assert closed == (cut == len(LISTED))
        if calls and not closed:  # the text after the calls starts after the last one's object
            assert end <= cut and LISTED[:end].rstrip().endswith("}") and LISTED[:end].count("{") == \
                LISTED[:end].count("}")
    assert seen == 3
    # Each call is read at the very character that closes its object.
    closes = [LISTED.index("]}}") + 3, LISTED.index('{x}"}}') + 6, len(LISTED) - 1]
    for n, close in enumerate(closes, 1):
        assert len(tool_parsers.listed_calls(LISTED[:close - 1])[0]) == n - 1
        assert len(tool_parsers.listed_calls(LISTED[:close])[0]) == n


@pytest.mark.parametrize("text", ["", "Sure: [", '{"name": "get_time"}', '[{"name": 3, "parameters": {}}]'])
def test_text_that_is_not_a_list_of_calls_gives_none(text):
    assert tool_parsers.listed_calls(text)[0] == []


def _deltas(text: str, size: int, logprobs: bool):
    """The text in deltas of `size` characters, token ids counting up."""
    for i in range(0, len(text), size):
        piece = text[i:i + size]
        delta = tandem_pb2.TokenDelta(text=piece, token_ids=[i])
        if logprobs:
            delta.logprobs.add(token_id=i, token=piece, logprob=-0.5)
        yield delta


def _final(reason) -> tandem_pb2.Completion:
    return tandem_pb2.Completion(finish_reason=reason)


def _stream(call, text: str, reason, size: int = 3, logprobs: bool = False) -> list[dict]:
    chunks = Chunks(call, "m")
    out = [c for d in _deltas(text, size, logprobs) for c in chunks.delta(0, d)]
    return out + chunks.final(0, _final(reason))


def _whole(call, text: str, reason, size: int = 3, logprobs: bool = False) -> dict:
    answer = Answer()
    for delta in _deltas(text, size, logprobs):
        answer.add(delta)
    answer.final = _final(reason)
    return response(call, "m", [answer])["choices"][0]


def _required(**more):
    return chat_call({"messages": ASK, "tools": [WEATHER, CLOCK], "tool_choice": "required", "stream": True,
                      "return_token_ids": True, **more})


@pytest.mark.parametrize("size", [1, 3, 200])
def test_a_required_list_streams_each_call_as_it_completes(size):
    chunks = _stream(_required(), LISTED, tandem_pb2.FINISH_REASON_EOS, size)
    calls = [(chunk_at, tc) for chunk_at, c in enumerate(chunks) for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [tc["index"] for _, tc in calls] == [0, 1, 2]
    assert _named([tc for _, tc in calls]) == CALLS
    assert all(tc["id"].startswith("call_") and tc["type"] == "function" for _, tc in calls)
    if size == 1:  # one call a chunk, each as its object closed: before the list did
        assert len({chunk_at for chunk_at, _ in calls}) == 3
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # Every token id goes out once, in order, held back text or not.
    ids = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    assert ids == list(range(0, len(LISTED), size))
    whole = _whole(_required(stream=False), LISTED, tandem_pb2.FINISH_REASON_EOS, size)
    assert whole["message"]["content"] is None and _named(whole["message"]["tool_calls"]) == CALLS
    assert whole["finish_reason"] == "tool_calls"


def test_a_required_list_cut_short_keeps_its_complete_calls_and_the_rest_as_text():
    cut = LISTED[:LISTED.index('"get_time"') + 5]
    chunks = _stream(_required(logprobs=True), cut, tandem_pb2.FINISH_REASON_LENGTH, 4, logprobs=True)
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert _named(calls) == CALLS[:2]
    assert content == cut[cut.index("}}, ") + 2:] and content.lstrip(", ").startswith('{"name": "get')
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == list(range(0, len(cut), 4))
    tokens = [lp["token"] for c in chunks if c["choices"][0]["logprobs"] for lp in c["choices"][0]["logprobs"]["content"]]
    assert "".join(tokens) == cut  # every token's log probability, once
    whole = _whole(_required(stream=False, logprobs=True), cut, tandem_pb2.FINISH_REASON_LENGTH, 4, logprobs=True)
    assert _named(whole["message"]["tool_calls"]) == CALLS[:2] and whole["message"]["content"] == content
    assert whole["finish_reason"] == "length"
    # Cut before any call is complete: all of it is text, as before.
    early = LISTED[:20]
    whole = _whole(_required(stream=False), early, tandem_pb2.FINISH_REASON_LENGTH)
    assert whole["message"] == {"role": "assistant", "content": early}
    chunks = _stream(_required(), early, tandem_pb2.FINISH_REASON_LENGTH)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == early


def test_text_held_back_by_a_tool_parser_keeps_its_token_ids_and_log_probabilities():
    text = 'Let me check.<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    call = chat_call({"messages": ASK, "tools": [CLOCK], "stream": True, "return_token_ids": True,
                      "logprobs": True}, tool_parser="hermes")
    chunks = _stream(call, text, tandem_pb2.FINISH_REASON_EOS, 5, logprobs=True)
    choices = [c["choices"][0] for c in chunks]
    assert "".join(ch["delta"].get("content") or "" for ch in choices) == "Let me check."
    assert _named([tc for ch in choices for tc in ch["delta"].get("tool_calls", [])]) == [("get_time", {})]
    assert [t for ch in choices for t in ch.get("token_ids", [])] == list(range(0, len(text), 5))
    assert "".join(lp["token"] for ch in choices if ch["logprobs"] for lp in ch["logprobs"]["content"]) == text
    assert choices[-1]["finish_reason"] == "tool_calls"
