"""Structured output (a JSON schema, a regex, choices, a Lark grammar): both
services mask what the grammar rules out (tandem.grammar), so greedy output
equals Hugging Face's generate on the target alone under the same grammar, and
sampled output keeps to the target's masked distribution.

The models are the tiny random ones with a tokenizer of one token per ASCII
character, whose end-of-sequence token is \\x03."""
import json
import re
import shutil

import grpc
import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from draft_service.server import DraftOptions
from orchestrator import tool_parsers
from tandem.grammar import GrammarMasks, apply_masks
from tandem.structured import build_grammar
from tests.conftest import Cluster, save_char_tokenizer

EOS = 3
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"},
                                           "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["id", "ok", "tag"], "additionalProperties": False}
FORMATS = {
    "regex": ("regex", r"[a-z]{3}-[0-9]{2}"),
    "choice": ("choice", ["yes", "no", "maybe", "yesterday"]),
    "json_schema": ("json_schema", json.dumps(SCHEMA)),
    "lark": ("lark", 'start: "(" num ("," num)* ")"\nnum: /[0-9]/'),
}


def _with_tokenizer(source: str, dest) -> str:
    """A copy of the model at `source` with the character tokenizer, \\x03 its
    end-of-sequence token (in its config and generation config too)."""
    shutil.copytree(source, dest)
    save_char_tokenizer(dest)
    path = dest / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["eos_token"] = chr(EOS)
    path.write_text(json.dumps(config))
    # The character models' template, showing the tools by name, and a call's city.
    (dest / "chat_template.jinja").write_text(
        "{% if tools %}tools: {{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}"
        "{% for c in m.get('tool_calls') or [] %}[{{ c.function.name }} {{ c.function.arguments.city }}]"
        "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    for name in ("config.json", "generation_config.json"):
        path = dest / name
        config = json.loads(path.read_text())
        config["eos_token_id"] = EOS
        path.write_text(json.dumps(config))
    return str(dest)


@pytest.fixture(scope="module")
def models(tiny_models, near_draft, tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    return {"target": _with_tokenizer(tiny_models["target"], root / "target"),
            "near": _with_tokenizer(near_draft, root / "near"),
            "other": _with_tokenizer(tiny_models["other"], root / "other")}


class Grammar(LogitsProcessor):
    """The reference: a fresh llguidance matcher per step over the tokens
    generated so far; any of the model's end tokens once the output is complete."""

    def __init__(self, grammar: str, tokenizer, prompt_len: int, vocab: int = 128, ends=(EOS,)):
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=list(ends))
        self.grammar, self.prompt_len, self.vocab, self.ends = grammar, prompt_len, vocab, list(ends)

    def __call__(self, input_ids, scores):
        for row, ids in enumerate(input_ids):
            matcher = llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0)
            assert matcher.consume_tokens(ids[self.prompt_len:].tolist())
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            allowed = torch.from_numpy(bits[: self.vocab].astype(bool))
            allowed[self.ends] = matcher.is_accepting()
            scores[row, ~allowed] = float("-inf")
        return scores


def reference(model_dir: str, prompt: str | list[int], grammar: str, n: int) -> list[int]:
    """Hugging Face generate(do_sample=False) on the target alone under the grammar."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode(prompt) if isinstance(prompt, str) else prompt])
    ends = model.generation_config.eos_token_id
    ends = [ends] if isinstance(ends, int) else list(ends)
    processor = Grammar(grammar, tokenizer, ids.shape[1], model.config.vocab_size, ends)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=ends, logits_processor=LogitsProcessorList([processor]))
    return out[0, ids.shape[1]:].tolist()


def structured(kind: str, spec) -> dict:
    return {"structured_output": {"choice": {"choices": spec}} if kind == "choice" else {kind: spec}}


def _complete(kind: str, spec, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    if kind == "choice":
        return text in spec
    if kind == "json_schema":
        value = json.loads(text)
        return set(value) == {"id", "ok", "tag"} and value["tag"] in ("red", "green", "blue")
    return re.fullmatch(r"\([0-9](,[0-9])*\)", text) is not None


# --- the masks ---------------------------------------------------------------------

def test_masks_are_a_function_of_the_tokens_whatever_the_matchers_did_before(models):
    """Masks computed through the kept matchers (rolled back, shared by
    sequences that part) equal a fresh matcher's, step by step; the request's
    end ids stand in for the grammar's end once the output is complete; a row
    after a token the grammar rules out, or after an end token, is left free."""
    tokenizer = AutoTokenizer.from_pretrained(models["target"])
    grammar = build_grammar("regex", r"(ab|ac)[0-9]{1,2}")
    masks = GrammarMasks(tokenizer, 128)
    fresh = Grammar(grammar, tokenizer, 0)

    def expected(tokens: list[int], ends) -> torch.Tensor:
        scores = torch.zeros(1, 128)
        fresh(torch.tensor([tokens], dtype=torch.long), scores)
        allowed = scores[0] == 0
        accepting = bool(allowed[EOS])
        allowed[EOS] = False
        if accepting:
            allowed[list(ends)] = True
        return allowed

    prompt = [ord(c) for c in "Q:"]
    for text, ends in [("ab12", (EOS,)), ("ac7", (EOS, 120)), ("ab", (EOS,)), ("ac45", (EOS,)), ("ab1", (EOS,))]:
        sequence = prompt + [ord(c) for c in text]
        for first in range(len(prompt), len(sequence)):  # blocks starting anywhere, in an order that rolls back
            rows = masks.mask_rows(grammar, ends, len(prompt), first, len(sequence) - first + 1, sequence)
            for i, row in enumerate(rows):
                assert torch.equal(torch.from_numpy(row), expected(sequence[len(prompt): first + i], ends)), (
                    text, first, i)
    sequence = prompt + [ord(c) for c in "axb"] + [EOS, ord("a")]
    rows = masks.mask_rows(grammar, (EOS,), len(prompt), len(prompt), 4, sequence)
    assert rows[0] is not None and rows[1] is not None and rows[1][ord("x")] == 0 and rows[2:] == [None, None]
    done = prompt + [ord(c) for c in "ab12"] + [EOS, ord("a")]
    rows = masks.mask_rows(grammar, (EOS,), len(prompt), len(done) - 2, 2, done)
    assert np.flatnonzero(rows[0]).tolist() == [EOS] and rows[1] is None
    # Where no token of the (here narrower) vocabulary goes on, the end is all that is left.
    narrow = GrammarMasks(tokenizer, 100)  # "d" is 100: out of it
    rows = narrow.mask_rows(build_grammar("regex", "ad"), (EOS,), 0, 0, 2, [ord("a")])
    assert np.flatnonzero(rows[0]).tolist() == [ord("a")] and np.flatnonzero(rows[1]).tolist() == [EOS]


def test_the_common_prefix_by_slices_is_the_first_difference():
    from tandem.grammar_after import common_prefix as _common_prefix

    rng = np.random.default_rng(4)
    for _ in range(2000):
        a = rng.integers(0, 3, rng.integers(0, 40)).tolist()
        b = a[: rng.integers(0, len(a) + 1)] + rng.integers(0, 3, rng.integers(0, 6)).tolist()
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert _common_prefix(a, b) == first == _common_prefix(b, a)


def test_masks_apply_by_the_shorter_index_list_as_a_plain_mask_would():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 1000, generator=generator)
    sparse = np.zeros(1000, dtype=bool)
    sparse[[3, 500, 999]] = True
    dense = np.ones(1000, dtype=bool)
    dense[[0, 7, 998]] = False
    out = logits.clone()
    apply_masks(out, [sparse, None, dense])
    for i, allowed in ((0, sparse), (2, dense)):
        torch.testing.assert_close(out[i], torch.where(torch.from_numpy(allowed), logits[i], float("-inf")))
    assert torch.equal(out[1], logits[1])


def test_a_grammar_that_does_not_compile_or_a_service_without_a_tokenizer_is_refused(models):
    with pytest.raises(ValueError, match="regex"):
        build_grammar("regex", "a(b")
    with pytest.raises(ValueError, match="not valid JSON"):
        build_grammar("json_schema", "{")
    with pytest.raises(ValueError, match="Invalid type"):
        build_grammar("json_schema", '{"type": "nothing"}')
    with pytest.raises(ValueError, match="non-empty"):
        build_grammar("choice", [])
    with pytest.raises(ValueError, match="tokenizer"):
        GrammarMasks(None, 128).check(build_grammar("regex", "a+"))


# --- end to end ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(models):
    cluster = Cluster(models["target"], models["near"], target_graphs="off")
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "sequential"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_greedy_under_a_grammar_equals_the_target_alone_under_it(cluster, models, name, pipeline):
    kind, spec = FORMATS[name]
    grammar = build_grammar(kind, spec)
    with cluster.client() as client:
        for prompt in ("A: ", "Answer with one word please: "):
            expected = reference(models["target"], prompt, grammar, 48)
            result = client.generate(prompt, max_tokens=48, pipeline=pipeline, num_draft_tokens=3,
                                     **structured(kind, spec))
            assert result.token_ids == expected
            if expected[-1] == EOS:
                assert result.finish_reason == "eos" and _complete(kind, spec, result.text)
    # The bounded formats always complete within 48 tokens.
    if name in ("regex", "choice"):
        assert expected[-1] == EOS


def test_a_draft_that_is_the_target_masks_alike_and_is_always_accepted(models):
    cluster = Cluster(models["target"], models["target"], target_graphs="off")
    try:
        kind, spec = FORMATS["json_schema"]
        expected = reference(models["target"], "A: ", build_grammar(kind, spec), 40)
        with cluster.client() as client:
            for pipeline in (True, False):
                result = client.generate("A: ", max_tokens=40, pipeline=pipeline, num_draft_tokens=4,
                                         **structured(kind, spec))
                assert result.token_ids == expected
                assert result.stats.drafted_tokens > 16
                assert result.stats.accepted_tokens == result.stats.drafted_tokens
    finally:
        cluster.stop()


@pytest.mark.parametrize("options", [DraftOptions(backend="ngram"), DraftOptions(vocab_subset=24)],
                         ids=["ngram", "reduced-head"])
def test_drafts_that_ignore_or_cannot_score_the_grammar_stay_lossless(models, options):
    """Prompt lookup drafts tokens the grammar may rule out; a reduced head
    may score none of the tokens it allows. The target's masks decide."""
    cluster = Cluster(models["target"], models["near"], target_graphs="off", draft_options=options)
    try:
        with cluster.client() as client:
            for name in ("regex", "json_schema"):
                kind, spec = FORMATS[name]
                prompt = "abc-12 abc-12 abc-1"
                expected = reference(models["target"], prompt, build_grammar(kind, spec), 32)
                for temperature in (0.0, 0.9):
                    result = client.generate(prompt, max_tokens=32, num_draft_tokens=3, temperature=temperature,
                                             seed=5, **structured(kind, spec))
                    if temperature == 0.0:
                        assert result.token_ids == expected
                    elif result.finish_reason == "eos":
                        assert _complete(kind, spec, result.text)
    finally:
        cluster.stop()


def test_sampled_output_is_reproducible_and_follows_the_masked_distribution(models):
    """Over 400 seeds, with an unrelated draft (most drafted tokens
    rejected), the choices come as often as the target alone samples them
    under the grammar: a product of its masked next-character probabilities."""
    from scipy.stats import chisquare

    choices = ["ab", "ac", "b", "ba", "c"]
    tokenizer = AutoTokenizer.from_pretrained(models["target"])
    model = AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    prompt = tokenizer.encode("Pick: ")

    def masked(prefix: str, allowed: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + tokenizer.encode(prefix)])).logits[0, -1]
        keep = torch.full_like(logits, float("-inf"))
        keep[allowed] = 0
        return (logits + keep).softmax(-1)

    a, b, c = (ord(x) for x in "abc")
    first = masked("", [a, b, c])
    after_a = masked("a", [b, c])
    after_b = masked("b", [a, EOS])
    exact = np.array([first[a] * after_a[b], first[a] * after_a[c], first[b] * after_b[EOS],
                      first[b] * after_b[a], first[c]], dtype=np.float64)
    exact /= exact.sum()
    n = 400
    counts = dict.fromkeys(choices, 0)
    cluster = Cluster(models["target"], models["other"], target_graphs="off")
    try:
        with cluster.client() as client:
            spec = structured("choice", choices)
            runs = [client.generate("Pick: ", max_tokens=4, temperature=1.0, seed=11, pipeline=p, **spec)
                    for p in (True, False)]
            assert runs[0].token_ids == runs[1].token_ids
            for seed in range(n):
                result = client.generate("Pick: ", max_tokens=4, temperature=1.0, seed=seed, num_draft_tokens=2,
                                         **spec)
                assert result.finish_reason == "eos" and result.text in counts
                counts[result.text] += 1
    finally:
        cluster.stop()
    observed = np.array([counts[ch] for ch in choices])
    assert chisquare(observed, exact * n).pvalue > 1e-3, (observed, exact * n)


def test_bad_structured_output_requests_get_invalid_argument(cluster, tiny_models):
    with cluster.client() as client:
        for params, words in [
            (structured("regex", "a(b"), "unclosed group"),
            (structured("json_schema", "{"), "not valid JSON"),
            ({**structured("regex", "a+"), "ignore_eos": True}, "ignore_eos"),
            ({**structured("regex", "a+"), "min_tokens": 2}, "min_tokens"),
            ({"structured_output": {}}, "names no format"),
        ]:
            with pytest.raises(grpc.RpcError) as caught:
                client.generate("A: ", max_tokens=8, **params)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, params
            assert words in caught.value.details(), caught.value.details()
        # The session and the server are unharmed: a good request right after.
        assert client.generate("A: ", max_tokens=8, **structured("regex", "[0-9]+")).text.isdigit()


# --- the HTTP API ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def http(cluster):
    from tests.test_http_api import _gateway

    base, stop = _gateway(cluster, "tandem-tiny")
    yield base
    stop()


def test_openai_and_vllm_structured_output_parameters_reach_the_models(http, cluster):
    from tests.test_http_api import client

    api = client(http)
    kind, spec = FORMATS["json_schema"]
    with cluster.client() as grpc_client:
        expected = grpc_client.generate("A: ", max_tokens=40, **structured(kind, spec)).token_ids
        for body in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
                     {"structured_outputs": {"json": SCHEMA}}, {"guided_json": json.dumps(SCHEMA)}):
            answer = api.completions.create(model="tandem-tiny", prompt="A: ", max_tokens=40, temperature=0,
                                            extra_body={**body, "return_token_ids": True})
            assert answer.choices[0].token_ids == expected, body
        choices = ["yes", "no", "maybe"]
        expected = grpc_client.generate("A: ", max_tokens=8, **structured("choice", choices)).text
    chat = api.chat.completions.create(model="tandem-tiny", messages=[{"role": "user", "content": "A?"}],
                                       max_tokens=8, temperature=0, extra_body={"guided_choice": choices})
    assert chat.choices[0].message.content in choices and chat.choices[0].finish_reason == "stop"
    answer = api.completions.create(model="tandem-tiny", prompt="A: ", max_tokens=8, temperature=0,
                                    extra_body={"structured_outputs": {"choice": choices}})
    assert answer.choices[0].text == expected
    # A GBNF grammar (vLLM's and llama.cpp's examples) is read as Lark.
    gbnf = 'root ::= "(" digit ("," digit)* ")"\ndigit ::= [0-9]'
    answer = api.completions.create(model="tandem-tiny", prompt="A: ", max_tokens=12, temperature=0,
                                    extra_body={"guided_grammar": gbnf})
    assert re.fullmatch(r"\([0-9](,[0-9])*\)?", answer.choices[0].text) or answer.choices[0].finish_reason == "length"
    streamed = "".join(chunk.choices[0].text for chunk in api.completions.create(
        model="tandem-tiny", prompt="A: ", max_tokens=8, temperature=0, stream=True,
        extra_body={"guided_regex": r"[a-z]{3}-[0-9]{2}"}))
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", streamed)
    json_object = api.chat.completions.create(model="tandem-tiny", messages=[{"role": "user", "content": "A?"}],
                                              max_tokens=48, temperature=0, response_format={"type": "json_object"})
    text = json_object.choices[0].message.content
    assert text.startswith("{") and (json_object.choices[0].finish_reason == "length" or
                                     isinstance(json.loads(text), dict))


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "xml"}}, "response_format", "'response_format.type'"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "with a 'schema'"),
    ({"guided_regex": "[0-9]+", "guided_choice": ["a"]}, "guided_choice", "give one structured output format"),
    ({"guided_choice": "yes"}, "guided_choice", "a list of strings"),
    ({"guided_regex": "a(b"}, None, "unclosed group"),  # the orchestrator's INVALID_ARGUMENT, passed on
    ({"guided_json": {"type": "nothing"}}, None, "Invalid type"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar", "not a grammar"),
])
def test_bad_structured_output_parameters_are_a_400_with_words(http, body, param, words):
    import openai

    from tests.test_http_api import client

    with pytest.raises(openai.BadRequestError) as caught:
        client(http).completions.create(model="tandem-tiny", prompt="A: ", max_tokens=4, extra_body=body)
    assert caught.value.status_code == 400 and words in caught.value.body["message"], caught.value.body
    assert caught.value.body["param"] == param


# --- tools: a named or required tool_choice is structured output --------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The forecast of a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


def test_a_named_tool_choice_answers_the_call_the_target_alone_makes_under_its_schema(http, cluster):
    from tests.test_http_api import client

    api = client(http)
    with cluster.client() as grpc_client:
        expected = grpc_client.generate(messages=ASK, tools=[WEATHER, CLOCK], max_tokens=60, structured_output={
            "json_schema": json.dumps(WEATHER["function"]["parameters"])})
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = api.chat.completions.create(model="tandem-tiny", messages=ASK, max_tokens=60, temperature=0,
                                         tools=[WEATHER, CLOCK], tool_choice=named)
    choice = answer.choices[0]
    if expected.finish_reason == "eos":
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        assert call.function.arguments == expected.text and choice.message.content is None
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
        assert choice.finish_reason == "stop"  # as OpenAI answers a forced call
    else:
        assert choice.message.content == expected.text and choice.finish_reason == "length"
    streamed = list(api.chat.completions.create(model="tandem-tiny", messages=ASK, max_tokens=60, temperature=0,
                                                tools=[WEATHER, CLOCK], tool_choice=named, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in streamed if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0][0].id and deltas[0][0].function.name == "get_weather"
    assert "".join(d[0].function.arguments for d in deltas) == expected.text
    assert streamed[-1].choices[0].finish_reason == ("stop" if expected.finish_reason == "eos" else "length")


def test_a_required_tool_choice_answers_a_list_of_calls(http, cluster):
    from tests.test_http_api import client

    from orchestrator.openai_api import _calls_schema

    api = client(http)
    with cluster.client() as grpc_client:
        expected = grpc_client.generate(messages=ASK, tools=[WEATHER, CLOCK], max_tokens=120, structured_output={
            "json_schema": json.dumps(_calls_schema([WEATHER, CLOCK]))})
    for stream in (False, True):
        reply = api.chat.completions.create(model="tandem-tiny", messages=ASK, max_tokens=120, temperature=0,
                                            tools=[WEATHER, CLOCK], tool_choice="required", stream=stream)
        if stream:
            chunks = list(reply)
            written = _assembled(chunks)
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = chunks[-1].choices[0].finish_reason
        else:
            calls, content = reply.choices[0].message.tool_calls or [], reply.choices[0].message.content
            written = [(c.function.name, c.function.arguments) for c in calls]
            finish = reply.choices[0].finish_reason
        listed, end, closed = tool_parsers.listed_calls(expected.text)
        if expected.finish_reason == "eos":
            wanted = json.loads(expected.text)
            assert [(name, json.loads(arguments)) for name, arguments in written] == \
                   [(w["name"], w["parameters"]) for w in wanted]
            assert finish == "tool_calls" and not content
            assert written == [(c["function"]["name"], c["function"]["arguments"]) for c in listed]
            continue
        # Cut by max_tokens: the calls complete before the cut, then the text after them; streamed,
        # a call whose arguments had begun went out as far as they went.
        assert written[:len(listed)] == [(c["function"]["name"], c["function"]["arguments"]) for c in listed]
        assert finish == "length"
        if stream and len(written) > len(listed):
            (name, arguments), = written[len(listed):]
            assert expected.text.endswith(arguments) and name in expected.text[end:]
            assert not content
        else:
            assert len(written) == len(listed) and content == expected.text[end:]


def test_parallel_tool_calls_false_answers_one_call_the_target_alone_makes(http, cluster):
    """tool_choice "required" with parallel_tool_calls false: a list of one
    call, the one the target alone makes under that schema."""
    from tests.test_http_api import client

    from orchestrator.openai_api import _calls_schema

    with cluster.client() as grpc_client:
        expected = grpc_client.generate(messages=ASK, tools=[WEATHER, CLOCK], max_tokens=160, structured_output={
            "json_schema": json.dumps(_calls_schema([WEATHER, CLOCK], one_call=True))})
    assert expected.finish_reason == "eos"  # the list closed after its one call
    (wanted,) = json.loads(expected.text)
    reply = client(http).chat.completions.create(model="tandem-tiny", messages=ASK, max_tokens=160, temperature=0,
                                                 tools=[WEATHER, CLOCK], tool_choice="required",
                                                 parallel_tool_calls=False)
    (call,) = reply.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (wanted["name"], wanted["parameters"])
    assert reply.choices[0].finish_reason == "tool_calls"


def test_tool_messages_reach_the_template_and_bad_tool_requests_get_a_400(http):
    import openai

    from tests.test_http_api import client

    api = client(http)
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Oslo", "days": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    answer = api.chat.completions.create(model="tandem-tiny", messages=history, max_tokens=4, temperature=0,
                                         tools=[WEATHER], tool_choice="none")
    assert answer.choices[0].message.tool_calls is None and answer.usage.completion_tokens > 0
    for kwargs, param, words in [
        (dict(tools=[WEATHER]), "tool_choice", "tool_choice 'auto'"),
        (dict(tools=[WEATHER], tool_choice="auto"), "tool_choice", "tool_choice 'auto'"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
         "not among the tools"),
        (dict(tool_choice="required"), "tool_choice", "needs 'tools'"),
        (dict(tools=[{"type": "function"}], tool_choice="required"), "tools[0]", "each tool must be"),
        (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
         "no other structured output"),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            api.chat.completions.create(model="tandem-tiny", messages=ASK, max_tokens=4, **kwargs)
        assert caught.value.body["param"] == param and words in caught.value.body["message"], caught.value.body


def _assembled(chunks) -> list[tuple[str, str]]:
    """A stream's tool calls put together by index, as a client does: (name, arguments)."""
    calls = []
    for chunk in chunks:
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if tc.index == len(calls):
                assert tc.id and tc.function.name
                calls.append((tc.function.name, tc.function.arguments or ""))
            else:
                assert tc.index == len(calls) - 1 and not tc.id and not tc.function.name
                calls[-1] = (calls[-1][0], calls[-1][1] + tc.function.arguments)
    return calls


def _named(calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_the_hermes_parser_takes_calls_out_of_the_text_and_holds_back_a_tag_in_the_making():
    from orchestrator.tool_parsers import parse, sendable

    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    content, calls = parse("hermes", text)
    assert content == "Let me look."
    assert _named(calls) == [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "CET"})]
    assert parse("hermes", "no calls here") == ("no calls here", None)
    assert parse("hermes", '<tool_call>\n{"name": "get_weather"')[1] is None  # cut short: the text as it came
    assert parse("hermes", '<tool_call>{"name": 5}</tool_call>')[1] is None
    assert [sendable("hermes", t) for t in ("abc", "abc<", "abc<tool_", "abc<tool_call>{", "a<b")] == [3, 3, 3, 3, 3]


@pytest.mark.parametrize("parser,text", [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}};'
                    '{"name": "get_time", "arguments": {"zone": "CET"}}'),
    ("mistral", '[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]'),
    ("mistral", ' [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]'),
    ("pythonic", '[get_weather(city="Oslo", days=2), get_time(zone="CET")]'),
    ("pythonic", '<|python_start|>[get_weather(city="Oslo", days=2), get_time(zone="CET")]<|python_end|>'),
])
def test_each_parser_reads_its_models_calls_and_holds_them_back_while_streamed(parser, text):
    from orchestrator.tool_parsers import parse, sendable

    content, calls = parse(parser, text)
    assert content is None
    assert _named(calls) == [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "CET"})]
    assert all(sendable(parser, text[:n]) == 0 for n in range(len(text) + 1))  # no part of a call goes out as text
    # Cut short, or not a call at all: the text as it came, streamed as it comes.
    assert parse(parser, text[:-3]) == (text[:-3], None)
    plain = "The weather in Oslo is mild."
    assert parse(parser, plain) == (plain, None) and sendable(parser, plain) == len(plain)


def test_the_whole_answer_parsers_leave_other_text_alone():
    from orchestrator.tool_parsers import parse, sendable

    assert parse("llama3_json", '{"name": "f", "parameters": {}} and then some') == \
        ('{"name": "f", "parameters": {}} and then some', None)
    assert parse("llama3_json", '{"city": "Oslo"}')[1] is None  # JSON, but not a call
    assert parse("pythonic", "[1, 2, 3]")[1] is None and parse("pythonic", "[f(*args)]")[1] is None
    assert parse("pythonic", "[f(x=open('/etc/passwd'))]")[1] is None  # literals only: nothing is evaluated
    assert parse("mistral", 'Checking. [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]')[0] == "Checking."
    assert sendable("mistral", "Checking. [TOOL_") == len("Checking. ")
    assert sendable("llama3_json", "  ") == 0 and sendable("llama3_json", "<|pyth") == 0
    assert sendable("pythonic", "Sure: [f()]") == len("Sure: [f()]")  # not at the start: text


@pytest.fixture(scope="module")
def http_tools(cluster):
    from orchestrator.http_gateway import Gateway, start

    async def serve():
        gateway = Gateway(cluster.address, "tandem-tiny", tool_call_parser="hermes")
        return (gateway, *await start(gateway, "127.0.0.1", 0))

    gateway, runner, port = cluster.run(serve())
    yield f"http://127.0.0.1:{port}"
    cluster.run(runner.cleanup())
    cluster.run(gateway.close())


def test_tool_choice_auto_parses_the_calls_the_model_writes(http_tools):
    """The tiny model is made to write a call in Qwen's format (a regex on its
    answer): the server's hermes parser turns it into tool_calls."""
    from tests.test_http_api import client

    api = client(http_tools)
    # (The character tokenizer, as llguidance reads it, writes no whitespace: the call is compact.)
    written = (r'Sure\.<tool_call>\{"name":"get_weather","arguments":\{"city":"(Oslo|Paris)",'
               r'"days":[1-9]\}\}</tool_call>')
    answer = api.chat.completions.create(model="tandem-tiny", messages=ASK, max_tokens=120, temperature=0,
                                         tools=[WEATHER, CLOCK], extra_body={"guided_regex": written})
    choice = answer.choices[0]
    assert choice.message.content == "Sure." and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and arguments["city"] in ("Oslo", "Paris")
    chunks = list(api.chat.completions.create(model="tandem-tiny", messages=ASK, max_tokens=120, temperature=0,
                                              tools=[WEATHER, CLOCK], tool_choice="auto", stream=True,
                                              extra_body={"guided_regex": written}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content.strip() == "Sure." and "<" not in content
    assert _assembled(chunks) == [("get_weather", call.function.arguments)]  # the model's text, as it came
    assert sum(len(c.choices[0].delta.tool_calls or []) for c in chunks if c.choices) > 2  # in pieces, not whole
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # An answer without a call, or with a tag that never becomes one, is text to the end.
    for regex, text in ((r"Hello", "Hello"), (r"abc<tool_", "abc<tool_")):
        plain = api.chat.completions.create(model="tandem-tiny", messages=ASK, max_tokens=20, temperature=0,
                                            tools=[WEATHER], extra_body={"guided_regex": regex})
        assert plain.choices[0].message.content == text and plain.choices[0].message.tool_calls is None
        streamed = list(api.chat.completions.create(model="tandem-tiny", messages=ASK, max_tokens=20,
                                                    temperature=0, tools=[WEATHER], stream=True,
                                                    extra_body={"guided_regex": regex}))
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
        assert streamed[-1].choices[0].finish_reason == "stop"


def test_a_server_with_the_pythonic_parser_answers_the_calls_llama_writes(cluster):
    """--tool-call-parser pythonic: a call list the tiny model is made to write
    is tool_calls, whole or streamed, and none of it goes out as content."""
    from orchestrator.http_gateway import Gateway, start
    from tests.test_http_api import client

    async def serve():
        gateway = Gateway(cluster.address, "tandem-tiny", tool_call_parser="pythonic")
        return (gateway, *await start(gateway, "127.0.0.1", 0))

    gateway, runner, port = cluster.run(serve())
    try:
        api = client(f"http://127.0.0.1:{port}")
        written = {"guided_regex": r'\[get_weather\(city="(Oslo|Paris)",days=[1-9]\)\]'}
        answer = api.chat.completions.create(model="tandem-tiny", messages=ASK, max_tokens=60, temperature=0,
                                             tools=[WEATHER, CLOCK], extra_body=written)
        choice = answer.choices[0]
        assert choice.message.content is None and choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Oslo", "Paris")
        chunks = list(api.chat.completions.create(model="tandem-tiny", messages=ASK, max_tokens=60, temperature=0,
                                                  tools=[WEATHER, CLOCK], stream=True, extra_body=written))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
        streamed = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls
                    for tc in c.choices[0].delta.tool_calls]
        assert [(tc.function.name, tc.function.arguments) for tc in streamed] == \
               [(call.function.name, call.function.arguments)]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    finally:
        cluster.run(runner.cleanup())
        cluster.run(gateway.close())


def test_a_chat_sessions_later_turn_keeps_to_its_own_format(cluster):
    """A format applies from the turn's first generated token: the history
    before it (the earlier turns, free text) is not held to it."""
    with cluster.client() as client:
        session = client.create_session()
        try:
            first = client.chat(session, "Hi", max_tokens=12)
            assert first.token_ids
            second = client.chat(session, "A date?", max_tokens=12, **structured("regex", r"[0-9]{4}-[0-9]{2}"))
            assert re.fullmatch(r"[0-9]{4}-[0-9]{2}", second.text) and second.finish_reason == "eos"
            third = client.chat(session, "Yes or no?", max_tokens=8, **structured("choice", ["yes", "no"]))
            assert third.text in ("yes", "no") and third.finish_reason == "eos"
        finally:
            client.delete_session(session)


def test_tokenize_renders_tools_and_calls_as_a_chat_completion_does(http):
    import urllib.request

    def tokenize(body: dict) -> dict:
        request = urllib.request.Request(f"{http}/tokenize", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            return json.load(reply)

    def text(body: dict) -> str:
        return "".join(chr(t) for t in tokenize(body)["tokens"])

    def rendered(words: str) -> str:  # the character tokenizer, as transformers loads it, drops whitespace
        return "".join(words.split())

    assert text({"messages": ASK}) == rendered("user: Weather in Oslo?\nassistant: ")
    assert text({"messages": ASK, "tools": [WEATHER, CLOCK]}) == \
        rendered("tools: get_weather,get_time\nuser: Weather in Oslo?\nassistant: ")
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    # A call's arguments reach the template as an object (its city read from it).
    assert text({"messages": history}) == \
        rendered("user: Weather in Oslo?\nassistant: [get_weather Oslo]\ntool: rain\nassistant: ")
