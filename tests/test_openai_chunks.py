"""The HTTP API's answers built from Generate's events, without a model: tool
calls streamed as they complete, and nothing of the text, its token ids or its
log probabilities lost where the stream holds text back."""
import json

import pytest

from orchestrator import tool_parsers
from orchestrator.openai_api import chat_call
from orchestrator.openai_chunks import Chunks
from orchestrator.openai_params import ApiError
from orchestrator.openai_response import Answer, response
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


def _assembled(chunks) -> list[dict]:
    """A stream's tool calls put together as a client does, by index: the
    first delta of each has its id, type and name, later ones only more of
    its arguments, and a new call takes the next index."""
    calls = []
    for chunk in chunks:
        for tc in chunk["choices"][0]["delta"].get("tool_calls", []):
            if tc["index"] == len(calls):
                assert tc["id"].startswith("call_") and tc["type"] == "function" and tc["function"]["name"]
                calls.append({"id": tc["id"], "type": "function", "function": dict(tc["function"]), "deltas": 1})
            else:
                assert tc["index"] == len(calls) - 1 and set(tc) == {"index", "function"}  # only the last one grows
                assert set(tc["function"]) == {"arguments"} and tc["function"]["arguments"]
                calls[-1]["function"]["arguments"] += tc["function"]["arguments"]
                calls[-1]["deltas"] += 1
    return calls


def _auto(parser, **more):
    return chat_call({"messages": ASK, "tools": [WEATHER, CLOCK], "stream": True, "return_token_ids": True,
                      **more}, tool_parser=parser)


WRITTEN = [  # (format, the model's answer, its content); the calls are CALLS
    ("required", LISTED, None),
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": [1, 2]}}'
               '\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris \\"Ville\\" {x}"}}'
               '\n</tool_call>\n<tool_call>\n{"name": "get_time"}\n</tool_call>', "Let me look."),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": [1, 2]}}; '
                    '{"name": "get_weather", "parameters": {"city": "Paris \\"Ville\\" {x}"}};'
                    '{"name": "get_time", "parameters": {}}', None),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": [1,2]}}, '
                '{"name": "get_weather", "arguments": {"city": "Paris \\"Ville\\" {x}"}}, '
                '{"name": "get_time", "arguments": {}}]', None),
]


@pytest.mark.parametrize("size", [1, 3, 200])
@pytest.mark.parametrize("parser,text,content", WRITTEN, ids=[w[0] for w in WRITTEN])
def test_calls_stream_their_arguments_as_the_model_writes_them(parser, text, content, size):
    call = _required if parser == "required" else lambda **more: _auto(parser, **more)
    chunks = _stream(call(), text, tandem_pb2.FINISH_REASON_EOS, size)
    streamed = _assembled(chunks)
    assert _named([c for c in streamed]) == CALLS
    whole = _whole(call(stream=False), text, tandem_pb2.FINISH_REASON_EOS, size)
    # The streamed arguments, put together, are the whole answer's: the model's own JSON text.
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == \
           [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    assert streamed[0]["function"]["arguments"] in text and streamed[1]["function"]["arguments"] in text
    if size == 1:  # a call goes out as its arguments begin, and they follow as they are written
        assert streamed[0]["deltas"] == len(streamed[0]["function"]["arguments"])
        assert streamed[1]["deltas"] > 10
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks).strip() == (content or "")
    assert whole["message"]["content"] == content and whole["finish_reason"] == "tool_calls"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # Every token id goes out once, in order, held back text or not.
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == list(range(0, len(text), size))


@pytest.mark.parametrize("parser", ["required", "hermes"])
def test_a_call_cut_short_in_its_arguments_stays_in_the_stream_as_far_as_it_went(parser):
    text = dict((w[0], w[1]) for w in WRITTEN)[parser]
    cut = text[:text.index('"Paris') + 4]
    call = _required if parser == "required" else lambda **more: _auto(parser, **more)
    chunks = _stream(call(), cut, tandem_pb2.FINISH_REASON_LENGTH, 2)
    streamed = _assembled(chunks)
    assert _named(streamed[:1]) == CALLS[:1]
    assert streamed[1]["function"]["name"] == "get_weather"
    assert cut.endswith(streamed[1]["function"]["arguments"]) and streamed[1]["function"]["arguments"].endswith('"Par')
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks).strip() == \
           ("" if parser == "required" else "Let me look.")  # nothing of the calls as text
    # Whole, the complete calls, and a call cut short is text ("required") or dropped (hermes' blocks).
    whole = _whole(call(stream=False), cut, tandem_pb2.FINISH_REASON_LENGTH, 2)
    assert _named(whole["message"]["tool_calls"]) == CALLS[:1]
    if parser == "required":
        assert whole["message"]["content"].lstrip(",\n ").startswith('{"name": "get_weather"')
    else:
        assert whole["message"]["content"] == "Let me look."
    assert whole["finish_reason"] == "length"


def test_a_required_list_cut_before_a_calls_arguments_keeps_its_complete_calls_and_the_rest_as_text():
    cut = LISTED[:LISTED.index('"get_time"') + 5]
    chunks = _stream(_required(logprobs=True), cut, tandem_pb2.FINISH_REASON_LENGTH, 4, logprobs=True)
    calls = _assembled(chunks)
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
    # Cut before any call is begun: all of it is text, as before.
    early = LISTED[:20]
    whole = _whole(_required(stream=False), early, tandem_pb2.FINISH_REASON_LENGTH)
    assert whole["message"] == {"role": "assistant", "content": early}
    chunks = _stream(_required(), early, tandem_pb2.FINISH_REASON_LENGTH)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == early
    assert not _assembled(chunks)


PYTHONIC = ('[get_weather(city="Oslo", days=[1, 2]), get_weather(city=\'Paris "Ville" {x}\'),\n'
            ' get_time()]')


@pytest.mark.parametrize("size", [1, 3, 200])
def test_pythonic_calls_go_out_one_by_one_each_whole_once_its_parenthesis_closes(size):
    chunks = _stream(_auto("pythonic"), PYTHONIC, tandem_pb2.FINISH_REASON_EOS, size)
    streamed = _assembled(chunks)
    assert _named(streamed) == CALLS and [c["deltas"] for c in streamed] == [1, 1, 1]
    whole = _whole(_auto("pythonic", stream=False), PYTHONIC, tandem_pb2.FINISH_REASON_EOS)
    assert [c["function"] for c in whole["message"]["tool_calls"]] == [c["function"] for c in streamed]
    assert whole["message"]["content"] is None and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)  # nothing of the calls as text
    # Each call goes out with the delta that writes its closing parenthesis: its token ids count characters.
    closes = [PYTHONIC.index("2])") + 3, PYTHONIC.index("}')") + 3, len(PYTHONIC) - 1]
    sent_with = [c["choices"][0]["token_ids"][-1] for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    if size == 1:
        assert sent_with == [close - 1 for close in closes]
    elif size == 200:  # one delta: the three calls in one chunk
        assert sent_with == [0]


@pytest.mark.parametrize("text", ['[get_time(), 7]', '[get_time(), f(x={1, 2})]', '[get_time()] and more'])
def test_a_pythonic_answer_that_breaks_off_keeps_the_calls_that_went_out(text):
    """A call that went out stays, as with the JSON formats; the rest of the
    text is not sent as content."""
    chunks = _stream(_auto("pythonic"), text, tandem_pb2.FINISH_REASON_EOS, 1)
    assert _named(_assembled(chunks)) == [("get_time", {})]
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)


def test_pythonic_calls_are_read_in_the_making_only_once_closed():
    seen = 0
    for cut in range(len(PYTHONIC) + 1):
        reading = tool_parsers.read("pythonic", PYTHONIC[:cut])
        assert [(c.name, json.loads(c.arguments)) for c in reading.calls] == CALLS[:len(reading.calls)]
        assert len(reading.calls) >= seen and all(c.end is not None for c in reading.calls)
        seen = len(reading.calls)
        assert reading.closed == (cut == len(PYTHONIC))
    with_tags = tool_parsers.read("pythonic", f"<|python_start|>{PYTHONIC}<|python_end|>")
    assert [c.name for c in with_tags.calls] == [name for name, _ in CALLS] and with_tags.closed
    assert tool_parsers.read("pythonic", "Sure: [get_time()]").calls == []  # text first: not calls
    assert tool_parsers.read("pythonic", '[f(x=float("nan"))]').calls == []  # not a literal


def test_text_held_back_by_a_tool_parser_keeps_its_token_ids_and_log_probabilities():
    text = 'Let me check.<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    call = chat_call({"messages": ASK, "tools": [CLOCK], "stream": True, "return_token_ids": True,
                      "logprobs": True}, tool_parser="hermes")
    chunks = _stream(call, text, tandem_pb2.FINISH_REASON_EOS, 5, logprobs=True)
    choices = [c["choices"][0] for c in chunks]
    assert "".join(ch["delta"].get("content") or "" for ch in choices) == "Let me check."
    assert _named(_assembled(chunks)) == [("get_time", {})]
    assert [t for ch in choices for t in ch.get("token_ids", [])] == list(range(0, len(text), 5))
    assert "".join(lp["token"] for ch in choices if ch["logprobs"] for lp in ch["logprobs"]["content"]) == text
    assert choices[-1]["finish_reason"] == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first_call_whole_and_streamed():
    text = dict((w[0], w[1]) for w in WRITTEN)["hermes"]
    for size in (1, 7):
        chunks = _stream(_auto("hermes", parallel_tool_calls=False), text, tandem_pb2.FINISH_REASON_EOS, size)
        assert _named(_assembled(chunks)) == CALLS[:1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == list(range(0, len(text), size))
    whole = _whole(_auto("hermes", stream=False, parallel_tool_calls=False), text, tandem_pb2.FINISH_REASON_EOS)
    assert _named(whole["message"]["tool_calls"]) == CALLS[:1] and whole["message"]["content"] == "Let me look."
    assert _named(_assembled(_stream(_auto("hermes", parallel_tool_calls=True), text,
                                     tandem_pb2.FINISH_REASON_EOS))) == CALLS  # true, OpenAI's default: all of them


def test_parallel_tool_calls_false_asks_a_required_list_of_one_and_a_bad_value_is_a_400():
    one = json.loads(_required(parallel_tool_calls=False).request.params.structured_output.json_schema)
    assert one["minItems"] == one["maxItems"] == 1
    assert "maxItems" not in json.loads(_required().request.params.structured_output.json_schema)
    with pytest.raises(ApiError) as refused:
        _required(parallel_tool_calls="no")
    assert refused.value.status == 400 and refused.value.param == "parallel_tool_calls"
