"""Reasoning read out of an answer (`--reasoning-parser`): the text between
<think> and </think> goes out as reasoning_content (a Response's reasoning
item), the rest as content; streamed pieces put together equal the whole
answer's, every token id goes out once, and no tag goes out at all. Without a
model (the parsing is logic), then end to end with the tiny pair."""
import dataclasses
import json

import pytest

from orchestrator import reasoning_parsers
from orchestrator.openai_api import chat_call
from orchestrator.openai_chunks import Chunks
from orchestrator.openai_response import Answer, response
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


def test_usage_counts_every_choices_reasoning_tokens_only_under_a_parser():
    from orchestrator.http_gateway import reasoned
    from orchestrator.openai_response import usage

    finals = [tandem_pb2.Completion(usage=tandem_pb2.Usage(prompt_tokens=5, completion_tokens=c, reasoning_tokens=r))
              for c, r in ((9, 4), (7, 7))]
    plain = chat_call({"messages": ASK, "n": 2})
    assert "completion_tokens_details" not in usage(plain, finals)
    for parser in reasoning_parsers.PARSERS:
        call = reasoned(chat_call({"messages": ASK, "n": 2}), parser)
        assert usage(call, finals)["completion_tokens"] == 16
        assert usage(call, finals)["completion_tokens_details"] == {"reasoning_tokens": 11}
        # The orchestrator counts them by the parser's tags: qwen3's answer opens its reasoning itself.
        sent = call.request.params.reasoning
        assert (sent.end, sent.start) == ("</think>", "<think>" if parser == "qwen3" else "")


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


@pytest.mark.parametrize("size", [1, 4])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_come_after_the_reasoning_and_set_its_grammar_waiting(choice, size):
    """tool_choice "required" or a named function: the call's grammar waits for
    the reasoning's end (structured_output.after), and the calls are read from
    the content that follows it, whole or streamed."""
    from orchestrator.http_gateway import reasoned
    from tests.test_openai_chunks import LISTED

    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    call = reasoned(chat_call({"messages": ASK, "stream": True, "tools": [WEATHER, CLOCK],
                               "tool_choice": tool_choice}), "deepseek_r1")
    assert call.reasoning_parser == "deepseek_r1"
    assert call.request.params.structured_output.after == "</think>"
    said = LISTED if choice == "required" else '{"city": "Oslo"}'
    text = "I need the tools.</think>" + said
    expected = CALLS if choice == "required" else [("get_weather", {"city": "Oslo"})]
    chunks = _stream(call, text, size)
    assert _named(_assembled(chunks)) == expected
    assert "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks) == "I need the tools."
    assert not "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    whole = _whole(dataclasses.replace(call, stream=False), text)
    assert whole["message"]["reasoning_content"] == "I need the tools."
    assert _named(whole["message"]["tool_calls"]) == expected


def test_a_responses_stream_has_a_reasoning_item_before_the_message():
    from orchestrator.responses_answer import Responses

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


def test_reasoning_effort_is_the_chat_templates_variable_of_that_name():
    """OpenAI's reasoning_effort (a Response's reasoning.effort) reaches the
    chat template as vLLM passes it, unless chat_template_kwargs sets it too."""
    import json

    from orchestrator.openai_params import ApiError
    from orchestrator.openai_responses import responses_call
    from orchestrator.responses_answer import Responses

    def variables(call):
        return json.loads(call.request.messages.chat_template_kwargs_json or "null")

    assert variables(chat_call({"messages": ASK, "reasoning_effort": "low"})) == {"reasoning_effort": "low"}
    assert variables(chat_call({"messages": ASK, "reasoning_effort": "low",
                                "chat_template_kwargs": {"reasoning_effort": "high", "x": 1}})) == {
        "reasoning_effort": "high", "x": 1}
    assert variables(chat_call({"messages": ASK})) is None
    with pytest.raises(ApiError) as refused:
        chat_call({"messages": ASK, "reasoning_effort": "extreme"})
    assert refused.value.param == "reasoning_effort" and "one of none, minimal, low, medium, high" in \
        refused.value.message
    body = {"input": "hi", "reasoning": {"effort": "minimal", "summary": "auto"}}
    assert variables(responses_call(body)) == {"reasoning_effort": "minimal"}
    assert Responses(body, "m").echoed["reasoning"] == {"effort": "minimal", "summary": "auto"}
    assert Responses({"input": "hi"}, "m").echoed["reasoning"] == {"effort": None, "summary": None}
    with pytest.raises(ApiError) as refused:
        responses_call({"input": "hi", "reasoning": "low"})
    assert refused.value.param == "reasoning"


def test_reasoning_items_of_an_earlier_answer_are_not_shown_to_the_model_again():
    from orchestrator.openai_responses import responses_call

    call = responses_call({"input": [{"role": "user", "content": "Hi"},
                                     {"type": "reasoning", "id": "rs_1", "summary": [],
                                      "content": [{"type": "reasoning_text", "text": "hmm"}]},
                                     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]})
    assert [(m.role, m.content) for m in call.request.messages.messages] == [
        ("user", "Hi"), ("assistant", "Hello."), ("user", "Bye")]


# --- a grammar that waits for the reasoning's end -------------------------------------------

def test_the_grammar_begins_after_the_token_that_ends_the_first_occurrence_of_the_text(models):  # noqa: F811
    from transformers import AutoTokenizer

    from tandem.grammar import GrammarMasks
    from tandem.sampling import SamplingParams

    masks = GrammarMasks(AutoTokenizer.from_pretrained(models["target"]), 128)

    def begins(after: str, text: str, start: int = 2, before: int | None = None):
        tokens = [ord(c) for c in text]
        return masks.begins([ord(c) for c in after], start, tokens, len(tokens) if before is None else before)

    assert begins("", "abc") == 2
    assert begins("9", "9019x") == 4  # the 9 before grammar_start does not count
    assert begins("78", "787178787") == 6  # the first whole one: a lone 7 is not it
    assert begins("78", "00785", before=3) is None  # only the tokens before `before` are known
    assert begins("78", "00785", before=4) == 4
    assert begins("78", "0017") is None
    with pytest.raises(ValueError, match="grammar_after"):
        SamplingParams(grammar_after=tuple(range(17)))


def test_rows_before_the_grammar_begins_are_free_and_those_after_masked_from_there(models):  # noqa: F811
    """adjust_logits over a block in which the reasoning's end comes: the rows
    up to it equal the logits, the rows after it are masked as a grammar
    starting right after it masks them."""
    import torch
    from transformers import AutoTokenizer

    from tandem.distributions import adjust_logits
    from tandem.grammar import GrammarMasks
    from tandem.sampling import SamplingParams
    from tandem.structured import build_grammar

    tokenizer = AutoTokenizer.from_pretrained(models["target"])
    masks = GrammarMasks(tokenizer, 128)
    grammar = build_grammar("regex", r"[0-9]{2}")
    after = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    assert len(after) == 8  # one token a character
    prompt = tokenizer.encode("Q: ")
    completion = tokenizer.encode("hm</think>4")
    tokens = prompt + completion
    params = SamplingParams(grammar=grammar, grammar_start=len(prompt), grammar_end_ids=(3,), grammar_after=after,
                            masks=masks)
    logits = torch.randn(len(completion) + 1, 128, generator=torch.Generator().manual_seed(3))
    out = adjust_logits(logits, params, len(prompt), tokens)
    begins = len(prompt) + len("hm</think>")
    free = begins - len(prompt)
    assert torch.equal(out[:free], logits[:free])
    plain = dataclasses.replace(params, grammar_after=(), grammar_start=begins)
    assert torch.equal(out[free:], adjust_logits(logits[free:], plain, begins, tokens))
    assert torch.isinf(out[free:]).any(dim=-1).all()  # the digits alone, then the end
    # A block before the end has come: nothing masked; one after it: as the plain grammar.
    assert torch.equal(adjust_logits(logits[:3], params, len(prompt), tokens), logits[:3])
    assert torch.equal(adjust_logits(logits[:2], params, begins, tokens), adjust_logits(logits[:2], plain, begins, tokens))


def test_a_prompt_that_closes_the_reasoning_itself_leaves_the_grammar_nothing_to_wait_for(models):  # noqa: F811
    from transformers import AutoTokenizer

    from orchestrator.request_params import closed_in_prompt

    tokenizer = AutoTokenizer.from_pretrained(models["target"])
    after = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    for text, closed in [("a: <think>\n\n</think>\n\n", True), ("a: </think>", True), ("a: </think> x", False),
                         ("a: <think>", False), ("", False)]:
        assert closed_in_prompt(tokenizer.encode(text), after, tokenizer) is closed, text
    assert closed_in_prompt(list(after) + [ord(" ")] * 8, after, tokenizer)
    assert not closed_in_prompt(list(after) + [ord(" ")] * 9, after, tokenizer)  # at most 8 tokens of whitespace
    assert not closed_in_prompt(tokenizer.encode("a: </think>"), (), tokenizer)


@pytest.mark.slow  # the default pair's tokenizer
def test_a_prompt_closes_the_reasoning_by_its_text_whatever_tokens_write_it():
    """A BPE tokenizer merges the tag's end with what follows in a template's
    text (Qwen2.5's writes ".</think>\n" as ".</", "think", ">\n"): the text decides."""
    from transformers import AutoTokenizer

    from orchestrator.request_params import closed_in_prompt
    from tandem.default_models import resolve_model
    from tandem.grammar import GrammarMasks

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("default-draft", progress=False))
    after = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    prompt = tokenizer.encode("<|im_start|>assistant\nParis.</think>\n")
    assert tuple(prompt[-len(after):]) != after  # the tokens do not show it
    assert closed_in_prompt(prompt, after, tokenizer)
    assert not closed_in_prompt(tokenizer.encode("<|im_start|>assistant\n</think> Paris."), after, tokenizer)
    # In a completion, the grammar begins after the token that ends the text, whatever tokens wrote it.
    masks = GrammarMasks(tokenizer, 151936)
    written = tokenizer.encode(" it is.</think>\n\n{", add_special_tokens=False)
    assert [tokenizer.decode([t]) for t in written] == [" it", " is", ".</", "think", ">\n\n", "{"]
    assert masks.begins(after, 3, [0, 1, 2] + written, 9) == 3 + 5
    assert masks.begins(after, 3, [0, 1, 2] + written, 7) is None


def _after_reference(model_dir: str, prompt: str, grammar: str, after: list[int], n: int) -> list[int]:
    """Hugging Face generate(do_sample=False) on the target alone, under the
    grammar from the token after the first whole `after` in the completion."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

    from tests.test_structured import EOS, Grammar

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode(prompt)])

    class AfterGrammar(LogitsProcessor):
        def __call__(self, input_ids, scores):
            completion = input_ids[0, ids.shape[1]:].tolist()
            found = next((i for i in range(len(completion) - len(after) + 1)
                          if completion[i:i + len(after)] == after), None)
            if found is None:
                return scores
            return Grammar(grammar, tokenizer, ids.shape[1] + found + len(after))(input_ids, scores)

    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=EOS, logits_processor=LogitsProcessorList([AfterGrammar()]))
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "sequential"])
def test_greedy_under_a_grammar_that_waits_equals_the_target_alone_under_it(cluster, models, pipeline):  # noqa: F811
    """structured_output.after: the completion is the target alone's, free up
    to the first whole `after`, then under the grammar. The random pair never
    writes "</think>", so `after` is two characters that its free answer does
    write; the grammar then takes over from there."""
    from transformers import AutoTokenizer

    from tandem.structured import build_grammar
    from tests.conftest import reference_greedy
    from tests.test_structured import EOS, FORMATS, structured

    prompt, n = "A: ", 40
    free = reference_greedy(models["target"], AutoTokenizer.from_pretrained(models["target"]).encode(prompt), n)
    at = next(i for i in range(1, n - 12) if all(32 < t < 127 and t != ord("?") for t in free[i:i + 2]))
    after = free[at:at + 2]
    with cluster.client() as client:
        for name in ("regex", "json_schema"):
            kind, spec = FORMATS[name]
            expected = _after_reference(models["target"], prompt, build_grammar(kind, spec), after, n)
            found = next(i for i in range(n) if expected[i:i + 2] == after)
            assert expected[:found + 2] == free[:found + 2] and expected[found + 2:] != free[found + 2:]
            request = structured(kind, spec)
            request["structured_output"]["after"] = "".join(map(chr, after))
            result = client.generate(prompt, max_tokens=n, pipeline=pipeline, num_draft_tokens=3, **request)
            assert result.token_ids == expected
            if expected[-1] == EOS:
                assert result.finish_reason == "eos"
            # Sampled with a seed: the same tokens pipelined and not.
            if pipeline:
                sampled = [client.generate(prompt, max_tokens=n, pipeline=p, temperature=0.8, seed=7, **request).token_ids
                           for p in (True, False)]
                assert sampled[0] == sampled[1]


def test_after_text_past_sixteen_tokens_is_invalid(cluster):  # noqa: F811
    import grpc

    from tests.test_structured import structured

    request = structured("regex", "[0-9]+")
    request["structured_output"]["after"] = "x" * 17
    with cluster.client() as client, pytest.raises(grpc.RpcError) as err:
        client.generate("A: ", max_tokens=4, **request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "after" in err.value.details()


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
            # The answer never closes its reasoning: deepseek_r1's is all reasoning, qwen3's has none.
            thought = whole.usage.completion_tokens if parser == "deepseek_r1" else 0
            assert whole.usage.completion_tokens_details.reasoning_tokens == thought
            chunks = list(api.chat.completions.create(model="tandem-tiny", messages=ASKED, max_tokens=30,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True}))
            deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
            assert "".join(d.get("reasoning_content") or "" for d in deltas) == (reasoning or "")
            assert "".join(d.get("content") or "" for d in deltas) == (content or "")
            assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thought
            answer = api.responses.create(model="tandem-tiny", input=ASKED[0]["content"], max_output_tokens=30,
                                          temperature=0, store=False)
            kinds = [item.type for item in answer.output]
            assert kinds == (["reasoning"] if parser == "deepseek_r1" else ["message"])
            if parser == "deepseek_r1":
                assert answer.output[0].content[0].text == said
            assert answer.usage.output_tokens_details.reasoning_tokens == (
                answer.usage.output_tokens if parser == "deepseek_r1" else 0)
            # A prompt that closed the reasoning (Qwen3's template with thinking off): content alone,
            # no reasoning tokens, under either parser.
            unthought = api.chat.completions.create(
                model="tandem-tiny", max_tokens=30, temperature=0,
                messages=ASKED + [{"role": "assistant", "content": "<think>\n\n</think>\n\n"}],
                extra_body={"continue_final_message": True, "add_generation_prompt": False})
            message = unthought.choices[0].message.model_dump()
            assert message["content"] and not message["reasoning_content"]
            assert unthought.usage.completion_tokens_details.reasoning_tokens == 0
            # A format waits for the reasoning's end, which this pair never writes: the answer is
            # the target alone's, free, read as above.
            formatted = api.chat.completions.create(
                model="tandem-tiny", messages=ASKED, max_tokens=30, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
            message = formatted.choices[0].message.model_dump()
            assert (message["reasoning_content"], message["content"]) == (reasoning, content)
            # Where the prompt closes the reasoning itself (Qwen3's template with thinking off), the
            # format applies from the first token: the content is its JSON.
            closed = api.chat.completions.create(
                model="tandem-tiny", max_tokens=60, temperature=0,
                messages=ASKED + [{"role": "assistant", "content": "<think>\n\n</think>\n\n"}],
                extra_body={"continue_final_message": True, "add_generation_prompt": False},
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
            message = closed.choices[0].message.model_dump()
            assert message["content"].startswith("{") and not message["reasoning_content"]
            deltas = [c.choices[0].delta.model_dump() for c in api.chat.completions.create(
                model="tandem-tiny", max_tokens=60, temperature=0, stream=True,
                messages=ASKED + [{"role": "assistant", "content": "<think>\n\n</think>\n\n"}],
                extra_body={"continue_final_message": True, "add_generation_prompt": False},
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}) if c.choices]
            assert "".join(d.get("content") or "" for d in deltas) == message["content"]
            assert not any(d.get("reasoning_content") for d in deltas)
            if closed.choices[0].finish_reason == "stop":
                assert set(json.loads(message["content"])) == {"id", "ok", "tag"}
        finally:
            stop()
