"""OpenAI's Responses API (POST /v1/responses), driven by the official client
over real HTTP and gRPC with the tiny pair: each Response says what the target
alone says (the chat completion of the same conversation), whole or as the
Response stream's events, with tools and structured output."""
import json

import openai
import pytest

from tests.test_http_api import client
from tests.test_logprobs import ATOL
from tests.test_structured import ASK, CLOCK, SCHEMA, WEATHER, cluster, http, models  # noqa: F401 (fixtures)

INSTRUCTIONS = "Answer briefly."


def _flat(tool: dict) -> dict:
    """A chat completion's tool as the Responses API writes it."""
    return {"type": "function", **tool["function"]}


def _events(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert added == done == list(range(len(events[-1].response.output)))  # each item added, then done, in turn
    return events


@pytest.mark.parametrize("formatted,status", [(False, "incomplete"), (True, "completed")],
                         ids=["cut-by-max-tokens", "ended-by-a-json-schema"])
def test_a_response_says_what_the_chat_completion_and_the_target_alone_say(http, cluster, formatted,  # noqa: F811
                                                                             status):
    """Free text cut by max_output_tokens (the tiny model writes no end token
    in 60), and JSON under a schema, which ends."""
    api = client(http)
    messages = [{"role": "system", "content": INSTRUCTIONS}, *ASK]
    max_tokens = 60
    grammar = {"structured_output": {"json_schema": json.dumps(SCHEMA)}} if formatted else {}
    fmt = {"text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}} if formatted else {}
    with cluster.client() as grpc_client:
        expected = grpc_client.generate(messages=messages, max_tokens=max_tokens, **grammar)
    assert status == ("completed" if expected.finish_reason == "eos" else "incomplete")
    chat = api.chat.completions.create(model="tandem-tiny", messages=messages, max_tokens=max_tokens, temperature=0,
                                       **({"response_format": {"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": SCHEMA}}} if formatted else {}))
    assert chat.choices[0].message.content == expected.text

    whole = api.responses.create(model="tandem-tiny", instructions=INSTRUCTIONS, input=ASK[0]["content"],
                                 max_output_tokens=max_tokens, temperature=0, **fmt)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.status == status
    assert whole.output_text == expected.text
    assert (whole.incomplete_details is None) == (status == "completed")
    if status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens == len(expected.token_ids)
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert whole.instructions == INSTRUCTIONS and whole.store is False

    events = _events(api.responses.create(model="tandem-tiny", instructions=INSTRUCTIONS,
                                          input=[{"role": "user", "content": [{"type": "input_text",
                                                                               "text": ASK[0]["content"]}]}],
                                          max_output_tokens=max_tokens, temperature=0, stream=True, **fmt))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == expected.text and len(deltas) > 1  # as the rounds commit
    assert [e.text for e in events if e.type == "response.output_text.done"] == [expected.text]
    final = events[-1].response
    assert events[-1].type == f"response.{status}" and final.status == status
    assert final.output_text == expected.text and final.id == events[0].response.id
    assert final.usage.output_tokens == len(expected.token_ids)
    assert final.tandem["rounds"] > 0  # the speculation stats, as a chat completion's last chunk has them
    # The client's own accumulation of the events (responses.stream) comes to the same Response.
    # (Its get_final_response wants response.completed; cut short, the stream ends with response.incomplete.)
    with api.responses.stream(model="tandem-tiny", instructions=INSTRUCTIONS, input=ASK[0]["content"],
                              max_output_tokens=max_tokens, temperature=0, **fmt) as stream:
        seen = list(stream)
        accumulated = stream.get_final_response() if status == "completed" else seen[-1].response
    assert "".join(e.delta for e in seen if e.type == "response.output_text.delta") == expected.text
    assert accumulated.output_text == expected.text and accumulated.status == status


def test_function_calls_and_their_outputs_in_the_input_reach_the_chat_template(http, cluster):  # noqa: F811
    api = client(http)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Oslo", "days": 1}'}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    chat = api.chat.completions.create(model="tandem-tiny", messages=history, tools=[WEATHER], tool_choice="none",
                                       max_tokens=30, temperature=0)
    items = [*ASK, {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                    "arguments": call["function"]["arguments"]},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"}]
    answer = api.responses.create(model="tandem-tiny", input=items, tools=[_flat(WEATHER)], tool_choice="none",
                                  max_output_tokens=30, temperature=0)
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage.input_tokens == chat.usage.prompt_tokens  # the same templated conversation
    # Without the call's output, the conversation is another one.
    other = api.responses.create(model="tandem-tiny", input=items[:2], tools=[_flat(WEATHER)], tool_choice="none",
                                 max_output_tokens=30, temperature=0)
    assert other.usage.input_tokens < answer.usage.input_tokens


def test_required_tool_calls_are_function_call_items_whole_or_streamed(http, cluster):  # noqa: F811
    api = client(http)
    chat = api.chat.completions.create(model="tandem-tiny", messages=ASK, tools=[WEATHER, CLOCK],
                                       tool_choice="required", max_tokens=160, temperature=0)
    assert chat.choices[0].finish_reason == "tool_calls"
    wanted = [(c.function.name, c.function.arguments) for c in chat.choices[0].message.tool_calls]
    body = dict(model="tandem-tiny", input=ASK[0]["content"], tools=[_flat(WEATHER), _flat(CLOCK)],
                tool_choice="required", max_output_tokens=160, temperature=0)
    whole = api.responses.create(**body)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == wanted and whole.status == "completed"
    assert all(c.call_id.startswith("call_") and c.id.startswith("fc_") for c in calls)

    events = _events(api.responses.create(**body, stream=True))
    final = events[-1].response
    assert [(c.name, c.arguments) for c in final.output if c.type == "function_call"] == wanted
    for at, item in enumerate(final.output):
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.output_index == at]
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done" and e.output_index == at]
        assert "".join(deltas) == done.arguments == item.arguments and done.name == item.name


def test_a_json_schema_format_constrains_the_response_as_response_format_does(http, cluster):  # noqa: F811
    api = client(http)
    chat = api.chat.completions.create(model="tandem-tiny", messages=ASK, max_tokens=60, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": SCHEMA}})
    answer = api.responses.create(model="tandem-tiny", input=ASK[0]["content"], max_output_tokens=60, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}})
    assert answer.output_text == chat.choices[0].message.content
    assert answer.text.format.type == "json_schema"


@pytest.mark.parametrize("body,param,words", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"input": "hi", "background": True}, "background", "not supported"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]", "only function tools"),
    ({"input": []}, "input", "non-empty list"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     "images and files"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]", "not supported"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format", "'json_schema'"),
])
def test_what_a_response_cannot_do_is_a_400_with_words(http, body, param, words):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as refused:
        client(http).responses.create(model="tandem-tiny", **body)
    error = refused.value.body
    assert error["param"] == param and words in error["message"], error


def test_parsing_keeps_to_the_chat_translation():
    """The conversion alone: a Responses body as the chat completion's."""
    from orchestrator.openai_responses import responses_call

    call = responses_call({"input": [{"role": "developer", "content": "Be terse."},
                                     {"role": "assistant", "content": "Checking."},
                                     {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                                     {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                                     {"type": "function_call_output", "call_id": "c1", "output": "1"}],
                           "max_output_tokens": 5, "parallel_tool_calls": False, "stream": True,
                           "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "g"}]},
                          tool_parser="hermes")
    messages = call.request.messages.messages
    assert [m.role for m in messages] == ["system", "assistant", "tool"]
    assert [c["id"] for c in json.loads(messages[1].tool_calls_json)] == ["c1", "c2"]  # one answer's calls
    assert messages[1].content == "Checking." and messages[2].tool_call_id == "c1"
    assert call.request.params.max_tokens == 5 and call.one_call and call.stream and call.include_usage


def test_text_then_calls_stream_as_a_message_item_then_function_call_items():
    """Without a model: hermes' answer (text, then three calls) through
    Chunks and the Response events, against the whole Response."""
    from orchestrator.openai_response import Answer, Chunks, response
    from orchestrator.openai_responses import Responses
    from tests.test_openai_chunks import CALLS, WRITTEN, _auto, _deltas, _final
    from tandem.v1 import tandem_pb2

    text = dict((w[0], w[1]) for w in WRITTEN)["hermes"]
    call = _auto("hermes", stream_options={"include_usage": True})
    shape = Responses({"input": "x"}, "m")
    chunks, events = Chunks(call, "m"), shape.events()
    out = events.start()
    final = _final(tandem_pb2.FINISH_REASON_EOS)
    for delta in _deltas(text, 2, False):
        out += [e for chunk in chunks.delta(0, delta) for e in events.chunk(chunk)]
    out += [e for chunk in [*chunks.final(0, final), chunks.usage([final])] for e in events.chunk(chunk)]
    out += events.end()
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    streamed = out[-1]["response"]
    assert out[-1]["type"] == "response.completed" and streamed["status"] == "completed"
    assert [item["type"] for item in streamed["output"]] == ["message", "function_call", "function_call",
                                                             "function_call"]
    assert streamed["output"][0]["content"][0]["text"].strip() == "Let me look."  # as streamed, the newline too
    assert [(i["name"], json.loads(i["arguments"])) for i in streamed["output"][1:]] == CALLS
    # An item is done before the next is added.
    kinds = [(e["type"], e.get("output_index")) for e in out if e["type"].startswith("response.output_item")]
    assert kinds == [(f"response.output_item.{k}", i) for i in range(4) for k in ("added", "done")]
    answer = Answer()
    for delta in _deltas(text, 2, False):
        answer.add(delta)
    answer.final = final
    whole = shape.whole(response(_auto("hermes", stream=False), "m", [answer]))
    assert whole["output"][0]["content"][0]["text"] == "Let me look."
    streamed["output"][0]["content"][0]["text"] = "Let me look."
    strip = lambda items: [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]  # noqa: E731
    assert strip(whole["output"]) == strip(streamed["output"])


def test_log_probabilities_are_the_chat_completions_whole_or_streamed(http, cluster):  # noqa: F811
    api = client(http)
    chat = api.chat.completions.create(model="tandem-tiny", messages=ASK, max_tokens=10, temperature=0,
                                       logprobs=True, top_logprobs=2)

    def listed(entries):
        return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in entries]

    def same(got, wanted):
        """The same tokens, and log probabilities as a verify's rows give them
        (their last bits follow how a round split the block: ATOL)."""
        assert [(t, [a for a, _ in top]) for t, _, top in got] == [(t, [a for a, _ in top]) for t, _, top in wanted]
        values = lambda entries: [v for _, lp, top in entries for v in (lp, *(b for _, b in top))]  # noqa: E731
        assert values(got) == pytest.approx(values(wanted), abs=ATOL)

    wanted = listed(chat.choices[0].logprobs.content)
    assert len(wanted) == 10 and all(len(top) == 2 for _, _, top in wanted)
    body = dict(model="tandem-tiny", input=ASK[0]["content"], max_output_tokens=10, temperature=0, top_logprobs=2,
                include=["message.output_text.logprobs"])
    whole = api.responses.create(**body)
    same(listed(whole.output[0].content[0].logprobs), wanted)
    events = _events(api.responses.create(**body, stream=True))
    streamed = listed([t for e in events if e.type == "response.output_text.delta" for t in e.logprobs])
    same(streamed, wanted)
    assert listed(events[-1].response.output[0].content[0].logprobs) == streamed
    plain = api.responses.create(model="tandem-tiny", input=ASK[0]["content"], max_output_tokens=10, temperature=0)
    assert plain.output[0].content[0].logprobs == []  # not asked, none
