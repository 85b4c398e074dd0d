"""Reasoning read out of an answer (`--reasoning-parser`): the text between
<think> and </think> goes out as reasoning_content (a Response's reasoning
item), the rest as content; streamed pieces put together equal the whole
answer's, every token id goes out once, and no tag goes out at all. Without a
model (the parsing is logic), then end to end with the tiny pair."""
import dataclasses

import pytest

from orchestrator import reasoning_parsers
from orchestrator.openai_api import chat_call
from orchestrator.openai_response import Answer, Chunks, response
from tandem.v1 import tandem_pb2
from tests.test_openai_chunks import ASK, CALLS, CLOCK, WEATHER, _assembled, _deltas, _final, _named
from tests.test_structured import cluster, models  # noqa: F401 (fixtures)

THINKING = "<think>\nThe user wants the weather. <b>Oslo</b> first.\n</think>\n\nIt is sunny in Oslo."


@pytest.mark.parametrize("parser,text,reasoning,content", [
    ("deepseek_r1", THINKING, "\nThe user wants the weather. <b>Oslo</b> first.\n", "\n\nIt is sunny in Oslo."),
    ("deepseek_r1", "Thinking without a tag</think>Answer.", "Thinking without a tag", "Answer."),
    ("deepseek_r1", "Cut short while thinking", "Cut short while thinking", None),
    ("deepseek_r1", "<think>x</think>", "x", None),
    ("qwen3", THINKING, "\nThe user wants the weather. <b>Oslo</b> first.\n", "\n\nIt is sunny in Oslo."),
    ("qwen3", "No thinking here.</think>", None, "No thinking here.</think>"),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "", None, None),
])
def test_a_whole_answer_splits_into_reasoning_and_content(parser, text, reasoning, content):
    assert reasoning_parsers.split(parser, text) == (reasoning, content)


def _call(parser, tools=False, **more):
    call = chat_call({"messages": ASK, "stream": True, "return_token_ids": True, "logprobs": True,
                      **({"tools": [WEATHER, CLOCK]} if tools else {}), **more},
                     tool_parser="hermes" if tools else None)
    return dataclasses.replace(call, reasoning_parser=parser)


def _stream(call, text, size):
    chunks = Chunks(call, "m")
    out = [c for d in _deltas(text, size, True) for c in chunks.delta(0, d)]
    return out + chunks.final(0, _final(tandem_pb2.FINISH_REASON_EOS))


def _whole(call, text):
    answer = Answer()
    for delta in _deltas(text, 3, True):
        answer.add(delta)
    answer.final = _final(tandem_pb2.FINISH_REASON_EOS)
    return response(call, "m", [answer])["choices"][0]


@pytest.mark.parametrize("size", [1, 3, 7, 200])
@pytest.mark.parametrize("parser", reasoning_parsers.PARSERS)
def test_streamed_reasoning_and_content_equal_the_whole_answers(parser, size):
    call = _call(parser)
    chunks = _stream(call, THINKING, size)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    whole = _whole(dataclasses.replace(call, stream=False), THINKING)["message"]
    assert (reasoning, content) == (whole["reasoning_content"], whole["content"])
    assert "<think>" not in reasoning + content and "</think>" not in reasoning + content
    ids = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    assert ids == list(range(0, len(THINKING), size))  # every token id, once, in order
    tokens = [lp["token"] for c in chunks if c["choices"][0]["logprobs"]
              for lp in c["choices"][0]["logprobs"]["content"]]
    assert "".join(tokens) == THINKING
    if size == 1:  # reasoning goes out as it comes: a piece a character, but the tags held
        assert sum(1 for d in deltas if d.get("reasoning_content")) > 30


@pytest.mark.parametrize("size", [1, 5])
def test_tool_calls_after_the_reasoning_stream_as_without_it(size):
    """hermes' calls in the content: read from the content alone, as without reasoning."""
    from tests.test_openai_chunks import WRITTEN

    written = dict((w[0], w[1]) for w in WRITTEN)["hermes"]
    text = "<think>I should call the tools.</think>" + written
    call = _call("deepseek_r1", tools=True)
    chunks = _stream(call, text, size)
    streamed = _assembled(chunks)
    assert _named(streamed) == CALLS
    assert "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks) == \
        "I should call the tools."
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks).strip() == "Let me look."
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = _whole(dataclasses.replace(call, stream=False), text)
    assert whole["message"]["reasoning_content"] == "I should call the tools."
    assert _named(whole["message"]["tool_calls"]) == CALLS and whole["finish_reason"] == "tool_calls"


def test_a_responses_stream_has_a_reasoning_item_before_the_message():
    from orchestrator.openai_responses import Responses

    from tests.test_responses import response_events

    call = _call("qwen3", stream_options={"include_usage": True})
    out = response_events(call, Responses({"input": "x"}, "m"), THINKING, 4)
    streamed = out[-1]["response"]["output"]
    assert [item["type"] for item in streamed] == ["reasoning", "message"]
    reasoning, content = reasoning_parsers.split("qwen3", THINKING)
    assert streamed[0]["content"][0]["text"] == reasoning == \
        "".join(e["delta"] for e in out if e["type"] == "response.reasoning_text.delta")
    assert [e["text"] for e in out if e["type"] == "response.reasoning_text.done"] == [reasoning]
    assert streamed[1]["content"][0]["text"] == content
    whole = Responses({"input": "x"}, "m").whole(response(dataclasses.replace(call, stream=False), "m", [
        _answer(THINKING)]))
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"][0]["text"] == reasoning


def _answer(text):
    answer = Answer()
    for delta in _deltas(text, 3, False):
        answer.add(delta)
    answer.final = _final(tandem_pb2.FINISH_REASON_EOS)
    return answer


def test_reasoning_items_of_an_earlier_answer_are_not_shown_to_the_model_again():
    from orchestrator.openai_responses import responses_call

    call = responses_call({"input": [{"role": "user", "content": "Hi"},
                                     {"type": "reasoning", "id": "rs_1", "summary": [],
                                      "content": [{"type": "reasoning_text", "text": "hmm"}]},
                                     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]})
    assert [(m.role, m.content) for m in call.request.messages.messages] == [
        ("user", "Hi"), ("assistant", "Hello."), ("user", "Bye")]


# --- end to end -----------------------------------------------------------------------------

def test_the_reasoning_parser_reshapes_what_the_target_alone_says(cluster):  # noqa: F811
    """With the tiny pair, whose answers hold no tags: deepseek_r1 reads them
    as reasoning alone (the template opened it), qwen3 as content alone;
    whole or streamed, chat or Responses; an answer a format constrains is
    content, unparsed."""
    from tests.test_http_api import _gateway, client
    from tests.test_structured import ASK as ASKED, SCHEMA

    with cluster.client() as grpc_client:
        said = grpc_client.generate(messages=ASKED, max_tokens=30).text
    assert said and "think>" not in said
    for parser in reasoning_parsers.PARSERS:
        base, stop = _gateway(cluster, "tandem-tiny", reasoning_parser=parser)
        try:
            api = client(base)
            reasoning, content = reasoning_parsers.split(parser, said)
            whole = api.chat.completions.create(model="tandem-tiny", messages=ASKED, max_tokens=30, temperature=0)
            message = whole.choices[0].message.model_dump()
            assert (message["reasoning_content"], message["content"]) == (reasoning, content)
            deltas = [c.choices[0].delta.model_dump() for c in api.chat.completions.create(
                model="tandem-tiny", messages=ASKED, max_tokens=30, temperature=0, stream=True) if c.choices]
            assert "".join(d.get("reasoning_content") or "" for d in deltas) == (reasoning or "")
            assert "".join(d.get("content") or "" for d in deltas) == (content or "")
            answer = api.responses.create(model="tandem-tiny", input=ASKED[0]["content"], max_output_tokens=30,
                                          temperature=0, store=False)
            kinds = [item.type for item in answer.output]
            assert kinds == (["reasoning"] if parser == "deepseek_r1" else ["message"])
            if parser == "deepseek_r1":
                assert answer.output[0].content[0].text == said
            formatted = api.chat.completions.create(
                model="tandem-tiny", messages=ASKED, max_tokens=40, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
            assert formatted.choices[0].message.content.startswith("{")
            assert "reasoning_content" not in formatted.choices[0].message.model_dump() or \
                formatted.choices[0].message.model_dump()["reasoning_content"] is None
        finally:
            stop()
