"""OpenAI's Responses API (POST /v1/responses), driven by the official client
over real HTTP and gRPC with the tiny pair: each Response says what the target
alone says (the chat completion of the same conversation), whole or as the
Response stream's events, with tools and structured output; stored responses
(in the real Redis) continue as their whole conversation would."""
import json

import grpc
import openai
import pytest
import redis

from tests.conftest import REDIS_URL
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
    assert whole.instructions == INSTRUCTIONS and whole.store is True and whole.previous_response_id is None

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
    ({"input": "hi", "conversation": "conv_1", "previous_response_id": "resp_1"}, "conversation", "cannot both"),
    ({"input": "hi", "conversation": 5}, "conversation", "conversation's id"),
    ({"input": "hi", "background": True}, "background", "not supported"),
    ({"input": "hi", "store": "yes"}, "store", "true or false"),
    ({"input": "hi", "truncation": "sometimes"}, "truncation", "'auto' or 'disabled'"),
    ({"input": "hi", "previous_response_id": 7}, "previous_response_id", "a string"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]", "only function tools"),
    ({"input": []}, "input", "non-empty list"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     "images and files"),
    ({"input": [{"type": "image_generation_call", "id": "ig_1"}]}, "input[0]", "not supported"),
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


def response_events(call, shape, text: str, size: int) -> list[dict]:
    """A streamed chat answer of `text`, in deltas of `size` characters, as
    the Response stream's events of `shape` (a Responses), from its first to
    its last."""
    from orchestrator.openai_chunks import Chunks
    from tandem.v1 import tandem_pb2
    from tests.test_openai_chunks import _deltas, _final

    chunks, events = Chunks(call, "m"), shape.events()
    out = events.start()
    final = _final(tandem_pb2.FINISH_REASON_EOS)
    for delta in _deltas(text, size, False):
        out += [e for chunk in chunks.delta(0, delta) for e in events.chunk(chunk)]
    out += [e for chunk in [*chunks.final(0, final), chunks.usage([final])] for e in events.chunk(chunk)]
    return out + events.end()


def test_text_then_calls_stream_as_a_message_item_then_function_call_items():
    """Without a model: hermes' answer (text, then three calls) through
    Chunks and the Response events, against the whole Response."""
    from orchestrator.openai_response import Answer, response
    from orchestrator.responses_answer import Responses
    from tests.test_openai_chunks import CALLS, WRITTEN, _auto, _deltas, _final
    from tandem.v1 import tandem_pb2

    text = dict((w[0], w[1]) for w in WRITTEN)["hermes"]
    shape = Responses({"input": "x"}, "m")
    out = response_events(_auto("hermes", stream_options={"include_usage": True}), shape, text, 2)
    final = _final(tandem_pb2.FINISH_REASON_EOS)
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


# --- stored responses -------------------------------------------------------------------

def _chat_text(api, messages: list[dict], **body) -> tuple[str, int]:
    chat = api.chat.completions.create(model="tandem-tiny", messages=messages, temperature=0, **body)
    return chat.choices[0].message.content, chat.usage.prompt_tokens


def test_a_stored_response_continues_as_its_whole_conversation_would(http, cluster):  # noqa: F811
    """previous_response_id: the stored input and output, then the new input,
    is the conversation the chat completion of it answers; its caches are
    reused; it is there to retrieve, list and delete, and stays in Redis for
    the orchestrator's --response-ttl."""
    api = client(http)
    first = api.responses.create(model="tandem-tiny", instructions=INSTRUCTIONS, input=ASK[0]["content"],
                                 max_output_tokens=12, temperature=0)
    assert first.store is True and first.output_text
    second = api.responses.create(model="tandem-tiny", instructions=INSTRUCTIONS, previous_response_id=first.id,
                                  input="And in Bergen?", max_output_tokens=12, temperature=0)
    conversation = [{"role": "system", "content": INSTRUCTIONS}, *ASK,
                    {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And in Bergen?"}]
    text, prompt_tokens = _chat_text(api, conversation, max_tokens=12)
    assert second.output_text == text and second.usage.input_tokens == prompt_tokens
    assert second.previous_response_id == first.id
    # The first turn's prompt was parked with its caches and taken over (--prefix-cache).
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # Without the stored turn, the conversation is another one.
    alone = api.responses.create(model="tandem-tiny", instructions=INSTRUCTIONS, input="And in Bergen?",
                                 max_output_tokens=12, temperature=0, store=False)
    assert alone.usage.input_tokens < second.usage.input_tokens

    assert api.responses.retrieve(first.id).model_dump() == first.model_dump()
    items = api.responses.input_items.list(second.id, order="asc").data
    assert [(i.type, i.role, i.content[0].text) for i in items] == [
        ("message", "user", ASK[0]["content"]), ("message", "assistant", first.output_text),
        ("message", "user", "And in Bergen?")]
    assert items[1].id == first.output[0].id and all(i.id for i in items)
    page = api.responses.input_items.list(second.id, limit=1)  # newest first
    assert [i.id for i in page.data] == [items[2].id] and page.has_more
    assert [i.id for i in api.responses.input_items.list(second.id, limit=5, after=items[2].id).data] == \
        [items[1].id, items[0].id]

    store = redis.Redis.from_url(REDIS_URL)
    ttl = store.ttl(f"tandem:default:response:{first.id}")
    assert 7 * 24 * 3600 - 60 < ttl <= 7 * 24 * 3600  # the orchestrator's --response-ttl, by default
    assert store.ttl(f"tandem:default:response:{alone.id}") == -2  # "store": false: not kept

    api.responses.delete(first.id)
    for gone in (lambda: api.responses.retrieve(first.id), lambda: api.responses.delete(first.id),
                 lambda: api.responses.retrieve(alone.id)):
        with pytest.raises(openai.NotFoundError):
            gone()
    with pytest.raises(openai.NotFoundError) as missing:
        api.responses.create(model="tandem-tiny", previous_response_id=first.id, input="Hi", max_output_tokens=4)
    assert missing.value.body["param"] == "previous_response_id" and "not found" in missing.value.body["message"]
    # The second keeps its whole conversation: it continues without the first.
    third = api.responses.create(model="tandem-tiny", previous_response_id=second.id, input="Thanks.",
                                 max_output_tokens=8, temperature=0)
    text, _ = _chat_text(api, [*conversation[1:], {"role": "assistant", "content": second.output_text},
                               {"role": "user", "content": "Thanks."}], max_tokens=8)
    assert third.output_text == text  # the instructions of a stored response are not carried over


def test_a_streamed_response_is_stored_as_its_last_event_says(http, cluster):  # noqa: F811
    api = client(http)
    events = _events(api.responses.create(model="tandem-tiny", input=ASK[0]["content"], max_output_tokens=10,
                                          temperature=0, stream=True))
    final = events[-1].response
    assert final.store is True and api.responses.retrieve(final.id).model_dump() == final.model_dump()
    quiet = _events(api.responses.create(model="tandem-tiny", input=ASK[0]["content"], max_output_tokens=4,
                                         temperature=0, stream=True, store=False))
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(quiet[-1].response.id)


def test_function_call_outputs_continue_a_stored_response_of_calls(http, cluster):  # noqa: F811
    """The agent loop: a response of calls, then their outputs by previous_response_id."""
    api = client(http)
    calls = api.responses.create(model="tandem-tiny", input=ASK[0]["content"], tools=[_flat(WEATHER)],
                                 tool_choice="required", max_output_tokens=160, temperature=0)
    made = [item for item in calls.output if item.type == "function_call"]
    assert made and calls.status == "completed"
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": f"Sunny, {20 + i} C"}
               for i, c in enumerate(made)]
    answer = api.responses.create(model="tandem-tiny", previous_response_id=calls.id, input=outputs,
                                  tools=[_flat(WEATHER)], tool_choice="none", max_output_tokens=20, temperature=0)
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in made]},
        *[{"role": "tool", "tool_call_id": o["call_id"], "content": o["output"]} for o in outputs]]
    text, prompt_tokens = _chat_text(api, history, tools=[WEATHER], tool_choice="none", max_tokens=20)
    assert answer.output_text == text and answer.usage.input_tokens == prompt_tokens


def test_a_tenant_reaches_only_its_own_stored_responses(http, cluster):  # noqa: F811
    mine, theirs = client(http, **{"x-tandem-tenant": "acme"}), client(http, **{"x-tandem-tenant": "globex"})
    kept = mine.responses.create(model="tandem-tiny", input=ASK[0]["content"], max_output_tokens=4, temperature=0)
    for reach in (lambda: theirs.responses.retrieve(kept.id), lambda: theirs.responses.delete(kept.id),
                  lambda: theirs.responses.create(model="tandem-tiny", previous_response_id=kept.id, input="Hi",
                                                  max_output_tokens=4)):
        with pytest.raises(openai.NotFoundError):
            reach()
    assert mine.responses.retrieve(kept.id).output_text == kept.output_text  # untouched by the other's delete


def test_stored_response_rpcs_check_what_they_keep(cluster):
    """The Tandem API's side: ids and JSON are checked (INVALID_ARGUMENT), a
    time to live is kept, an unknown id is NOT_FOUND."""
    from tandem.v1 import tandem_pb2, tandem_pb2_grpc

    with grpc.insecure_channel(cluster.address) as channel:
        stub = tandem_pb2_grpc.TandemStub(channel)
        for bad in (tandem_pb2.StoredResponse(response_id="a/b", body_json="{}"),
                    tandem_pb2.StoredResponse(response_id="x" * 129, body_json="{}"),
                    tandem_pb2.StoredResponse(response_id="resp_ok", body_json="[1]"),
                    tandem_pb2.StoredResponse(response_id="resp_ok", body_json="{not json")):
            with pytest.raises(grpc.RpcError) as refused:
                stub.PutStoredResponse(bad, timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
        reply = stub.PutStoredResponse(tandem_pb2.StoredResponse(response_id="resp_rpc", body_json='{"a": 1}',
                                                                 ttl_seconds=30), timeout=10)
        assert reply.ttl_seconds == 30 and 0 < redis.Redis.from_url(REDIS_URL).ttl("tandem:default:response:resp_rpc") <= 30
        got = stub.GetStoredResponse(tandem_pb2.StoredResponseRef(response_id="resp_rpc"), timeout=10)
        assert json.loads(got.body_json) == {"a": 1}
        # Its items: appended in order, checked, one taken out by id.
        items = [json.dumps({"id": f"i{n}", "n": n}) for n in range(3)]
        assert stub.AppendStoredItems(tandem_pb2.StoredItems(response_id="resp_rpc", items_json=items[:2]),
                                      timeout=10).length == 2
        assert stub.AppendStoredItems(tandem_pb2.StoredItems(response_id="resp_rpc", items_json=items[2:]),
                                      timeout=10).length == 3
        for bad in (['{"n": 1}'], ["[1]"], ["{nope"]):
            with pytest.raises(grpc.RpcError) as refused:
                stub.AppendStoredItems(tandem_pb2.StoredItems(response_id="resp_rpc", items_json=bad), timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
        with pytest.raises(grpc.RpcError) as missing:
            stub.AppendStoredItems(tandem_pb2.StoredItems(response_id="resp_none", items_json=items), timeout=10)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        assert stub.DeleteStoredItem(tandem_pb2.StoredItemRef(response_id="resp_rpc", item_id="i1"), timeout=10).deleted
        assert not stub.DeleteStoredItem(tandem_pb2.StoredItemRef(response_id="resp_rpc", item_id="i1"),
                                         timeout=10).deleted
        kept = stub.GetStoredItems(tandem_pb2.StoredResponseRef(response_id="resp_rpc"), timeout=10).items_json
        assert [json.loads(i)["id"] for i in kept] == ["i0", "i2"]
        assert stub.DeleteStoredResponse(tandem_pb2.StoredResponseRef(response_id="resp_rpc"), timeout=10).deleted
        assert not stub.DeleteStoredResponse(tandem_pb2.StoredResponseRef(response_id="resp_rpc"), timeout=10).deleted
        with pytest.raises(grpc.RpcError) as missing:
            stub.GetStoredResponse(tandem_pb2.StoredResponseRef(response_id="resp_rpc"), timeout=10)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        assert redis.Redis.from_url(REDIS_URL).exists("tandem:default:response:resp_rpc:items") == 0  # with it


def test_kept_input_items_have_ids_types_and_parts():
    from orchestrator.conversations import input_items
    from orchestrator.responses_routes import previous_items, record

    items = input_items({"input": [{"role": "user", "content": "Hi"},
                                   {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                                   {"type": "function_call_output", "call_id": "c1", "output": "1", "id": "fco_9"}]})
    assert items[0]["id"].startswith("msg_") and items[1]["id"].startswith("fc_")
    assert items[0] == {"id": items[0]["id"], "type": "message", "role": "user",
                        "content": [{"type": "input_text", "text": "Hi"}]}
    assert items[2]["id"] == "fco_9"  # given ids are kept
    assert input_items({"input": "Hey"})[0]["content"] == [{"type": "input_text", "text": "Hey"}]
    out = [{"id": "msg_1", "type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Yo"}]}]
    assert previous_items(record({"output": out}, items)) == [*items, *out]


def test_cancelling_a_response_is_for_background_ones_which_tandem_runs_none_of(http, cluster):  # noqa: F811
    api = client(http)
    kept = api.responses.create(model="tandem-tiny", input=ASK[0]["content"], max_output_tokens=2, temperature=0)
    with pytest.raises(openai.BadRequestError) as refused:
        api.responses.cancel(kept.id)
    assert "background" in refused.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        api.responses.cancel("resp_nothing_here")


# --- conversations --------------------------------------------------------------------------

def test_a_conversation_gathers_each_responses_input_and_output_and_answers_as_its_history(http, cluster):  # noqa: F811
    """OpenAI's Conversations API: items given at creation, then each
    response's input and output added; a response in it equals the chat
    completion of the whole history, whatever "store" says."""
    api = client(http)
    conversation = api.conversations.create(items=[{"type": "message", "role": "system", "content": INSTRUCTIONS}],
                                            metadata={"topic": "weather"})
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "weather"}
    first = api.responses.create(model="tandem-tiny", conversation=conversation.id, input=ASK[0]["content"],
                                 max_output_tokens=12, temperature=0)
    second = api.responses.create(model="tandem-tiny", conversation={"id": conversation.id}, input="And in Bergen?",
                                  max_output_tokens=12, temperature=0, store=False)
    history = [{"role": "system", "content": INSTRUCTIONS}, *ASK, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And in Bergen?"}]
    text, prompt_tokens = _chat_text(api, history, max_tokens=12)
    assert second.output_text == text and second.usage.input_tokens == prompt_tokens
    assert second.conversation.id == conversation.id and first.conversation.id == conversation.id
    items = api.conversations.items.list(conversation.id, order="asc").data
    assert [(i.role, i.content[0].text) for i in items] == [
        ("system", INSTRUCTIONS), ("user", ASK[0]["content"]), ("assistant", first.output_text),
        ("user", "And in Bergen?"), ("assistant", second.output_text)]
    assert items[2].id == first.output[0].id and items[4].id == second.output[0].id
    assert [i.id for i in api.conversations.items.list(conversation.id, limit=2).data] == [items[4].id, items[3].id]
    assert api.conversations.items.retrieve(items[1].id, conversation_id=conversation.id).content[0].text == \
        ASK[0]["content"]

    # Items added by hand, one taken out, the metadata replaced.
    added = api.conversations.items.create(conversation.id, items=[{"type": "message", "role": "user",
                                                                     "content": "Thanks."}]).data
    assert [i.content[0].text for i in added] == ["Thanks."]
    after = api.conversations.items.delete(items[3].id, conversation_id=conversation.id)
    assert after.id == conversation.id
    remaining = [i.id for i in api.conversations.items.list(conversation.id, order="asc").data]
    assert remaining == [items[0].id, items[1].id, items[2].id, items[4].id, added[0].id]
    store = redis.Redis.from_url(REDIS_URL)
    store.expire(f"tandem:default:response:{conversation.id}:items", 100)
    assert api.conversations.update(conversation.id, metadata={"topic": "rain"}).metadata == {"topic": "rain"}
    assert api.conversations.retrieve(conversation.id).metadata == {"topic": "rain"}
    # A change of the conversation's document gives its items its time to live again.
    assert store.ttl(f"tandem:default:response:{conversation.id}:items") > 7 * 24 * 3600 - 60

    # Another tenant reaches none of it; deleted, it is gone for responses too.
    other = client(http, **{"x-tandem-tenant": "globex"})
    with pytest.raises(openai.NotFoundError):
        other.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model="tandem-tiny", conversation=conversation.id, input="Hi", max_output_tokens=2)
    assert api.conversations.delete(conversation.id).deleted
    with pytest.raises(openai.NotFoundError):
        api.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError) as missing:
        api.responses.create(model="tandem-tiny", conversation=conversation.id, input="Hi", max_output_tokens=2)
    assert missing.value.body["param"] == "conversation"
    with pytest.raises(openai.NotFoundError):  # a stored response is no conversation
        api.conversations.retrieve(first.id)


def test_responses_at_once_in_one_conversation_lose_no_item(http, cluster):  # noqa: F811
    """Each response's items are added to its conversation atomically: four
    at once, and all their inputs and outputs are there."""
    from concurrent.futures import ThreadPoolExecutor

    api = client(http)
    conversation = api.conversations.create()
    questions = [f"Question {i}?" for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda q: api.responses.create(model="tandem-tiny", conversation=conversation.id,
                                                               input=q, max_output_tokens=4, temperature=0,
                                                               store=False), questions))
    items = api.conversations.items.list(conversation.id, order="asc", limit=100).data
    assert len(items) == 8
    asked = [i.content[0].text for i in items if i.role == "user"]
    assert sorted(asked) == sorted(questions)
    assert {i.id for i in items if i.role == "assistant"} == {a.output[0].id for a in answers}
    api.conversations.delete(conversation.id)


def test_truncation_auto_drops_the_oldest_turns_that_leave_no_room(http, cluster):  # noqa: F811
    """A conversation past the context window: a 400 by default; with
    "truncation": "auto" the answer to its latest turns that fit, which is the
    chat completion of those turns, and one turn more would not have fitted."""
    import urllib.request

    api = client(http)
    turns = []
    for i in range(10):
        turns += [{"type": "message", "role": "user", "content": f"Question {i}: " + "tell me more " * 4},
                  {"type": "message", "role": "assistant", "content": f"Answer {i}: " + "here is more " * 4}]
    conversation = api.conversations.create(items=turns)
    body = dict(model="tandem-tiny", conversation=conversation.id, input="And now?", max_output_tokens=16,
                temperature=0)
    with pytest.raises(openai.BadRequestError) as refused:
        api.responses.create(**body)
    assert "context window" in refused.value.body["message"]
    fitted = api.responses.create(**body, truncation="auto")
    assert fitted.truncation == "auto" and fitted.usage.input_tokens + 16 <= 512
    history = [{"role": t["role"], "content": t["content"]} for t in turns] + [{"role": "user", "content": "And now?"}]

    def counted(messages) -> int:
        request = urllib.request.Request(f"{http}/tokenize", data=json.dumps({"messages": messages}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as reply:
            return json.load(reply)["count"]

    (kept,) = [k for k in range(0, len(history), 2) if counted(history[k:]) == fitted.usage.input_tokens]
    assert kept > 0 and counted(history[kept - 2:]) + 16 > 512  # the fewest turns dropped
    text, _ = _chat_text(api, history[kept:], max_tokens=16)
    assert fitted.output_text == text
    # The conversation keeps every turn, the new one included.
    assert len(api.conversations.items.list(conversation.id, limit=100).data) == len(turns) + 2
