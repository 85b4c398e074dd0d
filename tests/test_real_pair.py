"""The real default pair (Qwen2.5-Coder 1.5B target, 0.5B draft), fp32, over
real gRPC: greedy Tandem output is token-identical to the target alone, under
a JSON schema too."""
import gc
import json

import pytest

from tandem.structured import build_grammar
from tests.conftest import Cluster, reference_greedy
from tests.test_structured import reference as reference_structured

SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                                      "arguments": {"type": "integer"}},
                     "required": ["name", "arguments"], "additionalProperties": False})

pytestmark = pytest.mark.slow
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def real_pair():
    from tandem.default_models import resolve_model

    return resolve_model("default-target"), resolve_model("default-draft")


def test_real_pair_greedy_identical_to_target_alone(real_pair):
    from transformers import AutoTokenizer

    target_dir, draft_dir = real_pair
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
        tokenize=True, add_generation_prompt=True, return_dict=False,
    )
    reference = reference_greedy(target_dir, prompt, NEW_TOKENS)
    # Structured output, on the real tokenizer's 151,936 tokens: a JSON schema.
    json_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a Python function as JSON with its name and argument count."}],
        tokenize=True, add_generation_prompt=True, return_dict=False,
    )
    structured = reference_structured(target_dir, json_prompt, build_grammar("json_schema", SCHEMA), 32)
    gc.collect()
    cluster = Cluster(target_dir, draft_dir, dtype="float32", k=3)
    try:
        with cluster.client() as client:
            for pipeline in (False, True):
                result = client.generate(prompt_ids=prompt, max_tokens=NEW_TOKENS, pipeline=pipeline)
                assert result.token_ids == reference
                assert result.stats.accepted_tokens > 0  # the real draft agrees with the target often
            text = client.generate(tokenizer.decode(prompt), max_tokens=8, num_draft_tokens=2)
            assert text.token_ids == reference[:8]  # text prompts tokenize to the same ids
            assert text.text == tokenizer.decode(reference[:8], skip_special_tokens=True)
            full = tokenizer.decode(reference, skip_special_tokens=True)
            stop = full[len(full) // 2:][:3]  # a string the completion is known to produce
            stopped = client.generate(prompt_ids=prompt, max_tokens=NEW_TOKENS, stop=[stop])
            assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop)
            assert stopped.text == full[: full.index(stop)]
            assert stopped.token_ids == reference[: len(stopped.token_ids)]
            shaped = client.generate(prompt_ids=json_prompt, max_tokens=32, structured_output={"json_schema": SCHEMA})
            assert shaped.token_ids == structured  # pipelined (the tiny models' tests run both ways)
            if shaped.finish_reason == "eos":
                assert set(json.loads(shaped.text)) == {"name", "arguments"}
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def tokenizer(real_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_pair[0])


def test_streamed_text_deltas_add_up_to_the_decoded_text(tokenizer):
    from orchestrator.text import Detokenizer

    ids = tokenizer.encode("def f(x):\n    return x ** 2  # ünïcödé ✓ 你好世界 🚀 done")
    detok, streamed = Detokenizer(tokenizer), ""
    for i in range(0, len(ids), 2):
        streamed += detok.add(ids[i:i + 2])
    assert streamed == tokenizer.decode(ids)


@pytest.mark.parametrize("ended_with_eos", [True, False])
def test_next_chat_turn_extends_the_committed_tokens(tokenizer, ended_with_eos):
    """Committed turn 1 + the new turn's tokens = the template's rendering of the
    whole conversation, so both caches are reused and nothing is re-encoded."""
    from orchestrator.text import ChatTemplate

    template = ChatTemplate(tokenizer, [tokenizer.convert_tokens_to_ids("<|im_end|>")])
    user1 = {"role": "user", "content": "Reverse a string s in Python."}
    reply = {"role": "assistant", "content": "Use s[::-1]."}
    user2 = {"role": "user", "content": "And a list?"}
    committed = template.first_turn([user1]) + tokenizer.encode(reply["content"])
    if ended_with_eos:
        committed.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    turn2 = template.next_turn([user1, reply], user2, committed)
    whole = tokenizer.apply_chat_template([user1, reply, user2], tokenize=True, add_generation_prompt=True,
                                          return_dict=False)
    assert committed + turn2 == whole


def test_a_reply_cut_after_a_token_that_starts_the_closing_still_gets_it_whole(tokenizer):
    """A reply cut by max_tokens right after "<" did not produce the "<" of the
    closing "<|im_end|>": the new turn starts with the whole end-of-turn token."""
    from orchestrator.text import ChatTemplate

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    template = ChatTemplate(tokenizer, [im_end])
    user1 = {"role": "user", "content": "Write some HTML."}
    committed = template.first_turn([user1]) + tokenizer.encode("<div>", add_special_tokens=False)
    committed.append(tokenizer.convert_tokens_to_ids("<"))
    reply = {"role": "assistant", "content": "<div><"}
    turn2 = template.next_turn([user1, reply], {"role": "user", "content": "More."}, committed)
    assert turn2[0] == im_end


def test_the_real_chat_template_shows_tools_and_calls_as_the_model_was_trained(tokenizer):
    """Tools reach Qwen's template, and an assistant's call's arguments, sent as
    OpenAI's JSON text, are written as an object, not as an escaped string."""
    from orchestrator.request_reader import read_tools, template_calls
    from orchestrator.text import ChatTemplate

    tools = read_tools(json.dumps([{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]))
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": template_calls(1, json.dumps(calls))},
                {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    text = ChatTemplate(tokenizer).first_turn_text(messages, tools)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\nrain\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
