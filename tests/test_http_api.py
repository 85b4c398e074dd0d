"""The OpenAI-compatible HTTP API, end to end: the official `openai` client over
a real HTTP socket, the gateway, the orchestrator's gRPC API, the two model
services and Redis. Greedy output equals Hugging Face's generate on the target
alone; errors come back as OpenAI's error bodies with the right HTTP status."""
import importlib.metadata
import json
import time
import urllib.error
import urllib.request
import uuid

import openai
import pytest
import redis
import torch
from transformers import AutoTokenizer

from tests.conftest import REDIS_URL, Cluster, reference_greedy
from tests.test_logprobs import ATOL, reference_logprobs
from tests.test_telemetry import recorded  # noqa: F401 (a fixture)

SYSTEM = "Answer briefly."


@pytest.fixture(scope="module")
def http(char_models):
    """(cluster, base URL, tokenizer): a cluster of the character-level pair
    and the HTTP gateway in front of its orchestrator."""
    cluster = Cluster(char_models["target"], char_models["draft"])
    base, stop = _gateway(cluster, "tandem-tiny")
    yield cluster, base, AutoTokenizer.from_pretrained(char_models["target"])
    stop()
    cluster.stop()


def _gateway(cluster: Cluster, served_model_name: str = "", **options):
    """The HTTP gateway in front of the cluster's orchestrator, on the cluster's
    loop (which its gRPC channel belongs to): (base URL, a function that stops it)."""
    from orchestrator.http_gateway import Gateway, start

    async def serve():
        gateway = Gateway(cluster.address, served_model_name, **options)
        return (gateway, *await start(gateway, "127.0.0.1", 0))

    gateway, runner, port = cluster.run(serve())

    def stop():
        cluster.run(runner.cleanup())
        cluster.run(gateway.close())

    return f"http://127.0.0.1:{port}", stop


def client(base: str, **headers) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120,
                         default_headers=headers or None)


def test_a_greedy_completion_equals_the_target_alone_streamed_or_not(http, char_models):
    cluster, base, tokenizer = http
    prompt = "def fib(n):\n    "
    prompt_ids = tokenizer.encode(prompt)
    expected = reference_greedy(char_models["target"], prompt_ids, 40)
    answer = client(base).completions.create(model="tandem-tiny", prompt=prompt, max_tokens=40, temperature=0,
                                             extra_body={"return_token_ids": True})
    choice = answer.choices[0]
    assert choice.token_ids == expected
    assert choice.text == tokenizer.decode(expected) and choice.finish_reason == "length"
    assert choice.stop_reason is None  # vLLM's: set only where a stop string or stop token ended it
    assert answer.object == "text_completion" and answer.model == "tandem-tiny"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(prompt_ids), 40)
    assert answer.usage.total_tokens == len(prompt_ids) + 40
    assert answer.tandem["rounds"] >= 1 and answer.tandem["drafted_tokens"] >= 1  # the speculation stats

    chunks = list(client(base).completions.create(
        model="tandem-tiny", prompt=prompt, max_tokens=40, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"return_token_ids": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [t for c in chunks if c.choices for t in c.choices[0].token_ids] == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40  # include_usage: last


def test_a_stop_string_ends_the_text_before_it_or_through_it(http, char_models):
    """vLLM's include_stop_str_in_output: the same tokens, the text through
    the stop string, whole or streamed."""
    cluster, base, tokenizer = http
    api = client(base)
    prompt = "def fib(n):\n    "
    full = api.completions.create(model="tandem-tiny", prompt=prompt, max_tokens=40, temperature=0).choices[0].text
    stop = full[12:15]
    at = full.find(stop)
    for include, text in ((False, full[:at]), (True, full[:at + len(stop)])):
        body = dict(model="tandem-tiny", prompt=prompt, max_tokens=40, temperature=0, stop=[stop],
                    extra_body={"include_stop_str_in_output": include})
        whole = api.completions.create(**body).choices[0]
        assert (whole.text, whole.finish_reason, whole.stop_reason) == (text, "stop", stop)
        chunks = list(api.completions.create(**body, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        closing = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
        assert [(c.finish_reason, c.stop_reason) for c in closing] == [("stop", stop)]
    # vLLM's stop_reason names the stop string that ended the text: the first
    # to begin, of two that begin there the shorter, whatever the list's order.
    # At j, a 3-character stop and its 2-character prefix begin, and one more
    # begins at j + 1, each there for the first time in the text.
    j = next(j for j in range(len(full) - 4)
             if full.find(full[j:j + 2]) == j and full.find(full[j + 1:j + 4]) == j + 1)
    whole = api.completions.create(model="tandem-tiny", prompt=prompt, max_tokens=40, temperature=0,
                                   stop=[full[j + 1:j + 4], full[j:j + 3], full[j:j + 2]]).choices[0]
    assert (whole.text, whole.finish_reason, whole.stop_reason) == (full[:j], "stop", full[j:j + 2])
    whole = api.completions.create(model="tandem-tiny", prompt=prompt, max_tokens=40, temperature=0,
                                   stop=[full[j + 1:j + 4], full[j:j + 3]]).choices[0]
    assert (whole.text, whole.stop_reason) == (full[:j], full[j:j + 3])
    messages = [{"role": "user", "content": "fib"}]
    said = api.chat.completions.create(model="tandem-tiny", messages=messages, max_tokens=24,
                                       temperature=0).choices[0].message.content
    chat_stop = said[8:10]
    for stream in (False, True):
        answer = api.chat.completions.create(model="tandem-tiny", messages=messages, max_tokens=24, temperature=0,
                                             stop=[chat_stop], stream=stream)
        last = list(answer)[-1].choices[0] if stream else answer.choices[0]
        assert (last.finish_reason, last.stop_reason) == ("stop", chat_stop)
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(model="tandem-tiny", prompt=prompt, max_tokens=4,
                               extra_body={"include_stop_str_in_output": "yes"})
    assert refused.value.body["param"] == "include_stop_str_in_output"


def test_token_id_prompts_and_the_models_list(http, char_models):
    _, base, _ = http
    ids = [100, 101, 102, 40, 41, 58]
    answer = client(base).completions.create(model="tandem-tiny", prompt=ids, max_tokens=16, temperature=0,
                                             extra_body={"return_token_ids": True})
    assert answer.choices[0].token_ids == reference_greedy(char_models["target"], ids, 16)
    assert [m.id for m in client(base).models.list()] == ["tandem-tiny"]
    with urllib.request.urlopen(f"{base}/health", timeout=30) as reply:
        health = json.load(reply)
    assert health["status"] == "ok" and health["target_model"] == char_models["target"]


def test_the_next_turn_of_a_stateless_chat_reuses_the_caches_of_the_last(http, char_models):
    """Each request resends the whole conversation; the second finds the first's
    parked session (--prefix-cache), prefills only what follows its tokens, and
    still equals the target alone on the templated conversation."""
    cluster, base, tokenizer = http

    def templated(messages):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "count to five, slowly"}]
    openai_client = client(base)
    first = openai_client.chat.completions.create(model="tandem-tiny", messages=messages, max_tokens=20,
                                                  temperature=0, extra_body={"return_token_ids": True})
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "and back"}]
    second = openai_client.chat.completions.create(model="tandem-tiny", messages=messages, max_tokens=20,
                                                   temperature=0, extra_body={"return_token_ids": True})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens == len(templated(messages))
    assert second.usage.prompt_tokens_details.cached_tokens >= len(templated(messages[:2]))
    assert second.choices[0].token_ids == reference_greedy(char_models["target"], templated(messages), 20)
    # The target ran what follows the reused tokens, and a token a round: not the reused prefix.
    reused = second.usage.prompt_tokens_details.cached_tokens
    assert second.tandem["target_prefill_tokens"] <= second.usage.prompt_tokens - reused + second.tandem["rounds"]


def test_a_chat_completion_renders_the_conversation_with_the_chat_template(http, char_models):
    """Stateless chat: the whole conversation each request. Its reply equals the
    target alone on the templated conversation, and the gRPC API's first Chat
    turn of a session with the same system prompt."""
    cluster, base, tokenizer = http
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello there"}]
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    templated = tokenizer.encode(templated, add_special_tokens=False)
    expected = reference_greedy(char_models["target"], templated, 30)
    answer = client(base).chat.completions.create(model="tandem-tiny", messages=messages, max_tokens=30,
                                                  temperature=0, extra_body={"return_token_ids": True})
    assert answer.choices[0].token_ids == expected
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == tokenizer.decode(expected)
    assert answer.object == "chat.completion" and answer.usage.prompt_tokens == len(templated)
    with cluster.client() as grpc_client:
        session = grpc_client.create_session(system_prompt=SYSTEM)
        assert grpc_client.chat(session, "hello there", max_tokens=30, temperature=0.0).token_ids == expected
        assert grpc_client.delete_session(session)

    chunks = list(client(base).chat.completions.create(
        model="tandem-tiny", messages=[*messages[:1], {"role": "user", "content": [
            {"type": "text", "text": "hello"}, {"type": "text", "text": " there"}]}],  # content as parts
        max_completion_tokens=30, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == tokenizer.decode(expected)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logprobs_come_as_openai_lays_them_out_and_are_the_target_alones(http, char_models):
    """A completion's logprobs (tokens, token_logprobs, top_logprobs maps with
    the token itself, text_offset) and a chat completion's (content entries
    with bytes and top_logprobs), streamed or not: each value is the target
    alone's log-softmax at the token's position."""
    _, base, tokenizer = http
    prompt = "def fib(n):\n    "
    prompt_ids = tokenizer.encode(prompt)
    expected = reference_greedy(char_models["target"], prompt_ids, 20)
    reference = reference_logprobs(char_models["target"], prompt_ids, expected)
    text = tokenizer.decode(expected)
    body = dict(model="tandem-tiny", prompt=prompt, max_tokens=20, temperature=0, logprobs=3)
    whole = client(base).completions.create(**body).choices[0].logprobs
    chunks = list(client(base).completions.create(**body, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(streamed) > 1  # each delta carries its own tokens'
    joined = {key: [v for part in streamed for v in getattr(part, key)] for key in
              ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    for answer in (whole.model_dump(), joined):
        assert answer["tokens"] == [tokenizer.decode([t]) for t in expected] and "".join(answer["tokens"]) == text
        assert answer["text_offset"] == [len(text[:i]) for i in range(len(expected))]
        for i, (token, value, top) in enumerate(zip(expected, answer["token_logprobs"], answer["top_logprobs"])):
            assert value == pytest.approx(reference[i, token].item(), abs=ATOL)
            assert len(top) == 3 and tokenizer.decode([token]) in top  # greedy: the token is the likeliest
            for piece, top_value in top.items():
                assert top_value == pytest.approx(reference[i, tokenizer.convert_tokens_to_ids(piece)].item(), abs=ATOL)

    messages = [{"role": "user", "content": "hello"}]
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    expected = reference_greedy(char_models["target"], chat_ids, 12)
    reference = reference_logprobs(char_models["target"], chat_ids, expected)
    body = dict(model="tandem-tiny", messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    whole = client(base).chat.completions.create(**body).choices[0].logprobs.content
    chunks = list(client(base).chat.completions.create(**body, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    for content in (whole, streamed):
        assert [e.token for e in content] == [tokenizer.decode([t]) for t in expected]
        for i, (token, entry) in enumerate(zip(expected, content)):
            assert entry.bytes == list(entry.token.encode())
            assert entry.logprob == pytest.approx(reference[i, token].item(), abs=ATOL)
            assert [t.token for t in entry.top_logprobs][0] == entry.token and len(entry.top_logprobs) == 2
    unasked = client(base).chat.completions.create(**{**body, "logprobs": False, "top_logprobs": None})
    assert unasked.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="needs 'logprobs': true"):
        client(base).chat.completions.create(**{**body, "logprobs": False})


def test_a_seeded_sampled_request_equals_the_grpc_api_with_the_same_seed(http):
    cluster, base, _ = http
    params = dict(max_tokens=32, temperature=0.9, top_p=0.95, seed=1234)
    answers = [client(base).completions.create(model="tandem-tiny", prompt="Once upon a time", extra_body={
        "return_token_ids": True, "top_k": 50}, **params).choices[0].token_ids for _ in range(2)]
    with cluster.client() as grpc_client:
        expected = grpc_client.generate("Once upon a time", top_k=50, **params).token_ids
    assert answers == [expected, expected]
    # OpenAI's default temperature is 1: an unseeded request samples (two differ).
    unseeded = {client(base).completions.create(model="tandem-tiny", prompt="Once upon a time", max_tokens=32).choices[0].text
                for _ in range(3)}
    assert len(unseeded) > 1


def test_n_choices_are_generations_of_their_own(http, char_models):
    """n > 1: a Generate call per choice, at once. Greedy, each choice is the
    target alone's; seeded, choice i is the gRPC API's with seed + i; streamed,
    each choice's chunks carry its index and join to its whole answer."""
    cluster, base, tokenizer = http
    prompt = "Once upon a time"
    expected = reference_greedy(char_models["target"], tokenizer.encode(prompt), 16)
    answer = client(base).completions.create(model="tandem-tiny", prompt=prompt, max_tokens=16, temperature=0, n=3,
                                             extra_body={"return_token_ids": True})
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert all(c.token_ids == expected for c in answer.choices)
    assert answer.usage.completion_tokens == 48 and answer.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert isinstance(answer.tandem, list) and len(answer.tandem) == 3

    params = dict(max_tokens=24, temperature=1.0, seed=77)
    sampled = client(base).completions.create(model="tandem-tiny", prompt=prompt, n=3,
                                              extra_body={"return_token_ids": True}, **params)
    with cluster.client() as grpc_client:
        each = [grpc_client.generate(prompt, **{**params, "seed": 77 + i}).token_ids for i in range(3)]
    assert [c.token_ids for c in sampled.choices] == each and len({tuple(ids) for ids in each}) > 1

    messages = [{"role": "user", "content": "hello"}]
    body = dict(model="tandem-tiny", messages=messages, max_tokens=20, temperature=1.0, seed=5, n=2)
    whole = client(base).chat.completions.create(**body)
    chunks = list(client(base).chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert [m.delta.role for m in mine].count("assistant") == 1 and mine[0].delta.role == "assistant"
        assert "".join(m.delta.content or "" for m in mine) == whole.choices[index].message.content
        assert [m.finish_reason for m in mine if m.finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40


def test_echo_and_batches_serve_loglikelihood_requests_as_lm_eval_sends_them(http, char_models):
    """lm-evaluation-harness's loglikelihood request: a batch of token id
    prompts, "echo", "max_tokens": 0, "logprobs": 1, greedy. Each choice holds
    its prompt alone, each token's log probability but the first's as the
    target alone gives it. With tokens to generate, the completion follows the
    prompt; a batch's choices come at index p * n + i; streamed, the prompt
    comes first."""
    _, base, tokenizer = http
    target = char_models["target"]
    texts = ["def fib(n):", "Once upon a time", "The sea"]
    batch = [tokenizer.encode(t) for t in texts]
    answer = client(base).completions.create(model="tandem-tiny", prompt=batch, echo=True, max_tokens=0, logprobs=1,
                                             temperature=0)
    assert [c.index for c in answer.choices] == [0, 1, 2] and answer.usage.completion_tokens == 0
    assert answer.usage.prompt_tokens == sum(len(ids) for ids in batch)
    for choice, ids in zip(answer.choices, batch):
        text = tokenizer.decode(ids)  # token ids come back as the server decodes them
        assert choice.text == text and choice.finish_reason == "length"
        lp = choice.logprobs
        assert lp.tokens == [tokenizer.decode([t]) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        reference = reference_logprobs(target, ids[:1], ids[1:])
        for i, (token, value, top) in enumerate(zip(ids[1:], lp.token_logprobs[1:], lp.top_logprobs[1:])):
            assert value == pytest.approx(reference[i, token].item(), abs=ATOL)
            assert chr(reference[i].argmax().item()) in top  # the likeliest, and the token itself
        assert lp.text_offset == list(range(len(text)))

    ids = batch[0]
    expected = reference_greedy(target, ids, 6)
    body = dict(model="tandem-tiny", prompt=texts[0], echo=True, max_tokens=6, logprobs=2, temperature=0)
    whole = client(base).completions.create(**body).choices[0]
    assert whole.text == texts[0] + tokenizer.decode(expected)  # a text prompt comes back as sent
    reference = reference_logprobs(target, ids[:1], ids[1:] + expected)
    assert whole.logprobs.token_logprobs[1:] == pytest.approx(
        [reference[i, t].item() for i, t in enumerate(ids[1:] + expected)], abs=ATOL)
    chunks = list(client(base).completions.create(**body, stream=True))
    assert chunks[0].choices[0].text == texts[0]  # the prompt first, then the rounds' tokens
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-6)

    several = client(base).completions.create(model="tandem-tiny", prompt=texts, n=2, max_tokens=8, temperature=0,
                                              extra_body={"return_token_ids": True})
    assert [c.index for c in several.choices] == list(range(6))
    for choice in several.choices:
        assert choice.token_ids == reference_greedy(target, batch[choice.index // 2], 8)
    with pytest.raises(openai.BadRequestError, match="a chat completion does not echo"):
        client(base).chat.completions.create(model="tandem-tiny", messages=[{"role": "user", "content": "x"}],
                                             extra_body={"echo": True})


def _assert_vllm_prompt_logprobs(scored: list, ids: list[int], reference, most: int) -> None:
    """vLLM's "prompt_logprobs" of a prompt: null for the first token, then a
    map of the token's id and the `most` likeliest ids to the log probability,
    the rank and the token; each value is the target alone's, and the token's
    rank counts the tokens likelier than it (within the kernels' tolerance)."""
    assert len(scored) == len(ids) and scored[0] is None
    for i, (token, entry, row) in enumerate(zip(ids[1:], scored[1:], reference)):
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(row[token].item(), abs=ATOL), i
        fewest, most_likelier = ((row > own["logprob"] + ATOL).sum().item(), (row > own["logprob"] - ATOL).sum().item())
        assert 1 + fewest <= own["rank"] <= 1 + most_likelier, i
        likeliest = {key: value for key, value in entry.items() if key != str(token) or value["rank"] <= most}
        assert len(likeliest) == most and sorted(v["rank"] for v in likeliest.values()) == list(range(1, most + 1))
        assert list(entry)[0] == str(token) and len(entry) in (most, most + 1)
        for key, value in entry.items():
            assert value["logprob"] == pytest.approx(row[int(key)].item(), abs=ATOL)
            assert value["decoded_token"] == chr(int(key))  # the character-level tokenizer
        torch.testing.assert_close(torch.tensor(sorted((v["logprob"] for v in likeliest.values()), reverse=True)),
                                   row.topk(most).values, atol=ATOL, rtol=0)


def test_vllm_prompt_logprobs_and_prompt_token_ids(http, char_models):
    """vLLM's "prompt_logprobs": N (not streamed) scores each prompt token as
    the target alone does, with its rank and the N likeliest at its position,
    on a completion's choices and at a chat completion's top level, and
    changes no generated token. "return_token_ids" brings the prompt's ids
    too, whole or with a streamed choice's first chunk."""
    _, base, tokenizer = http
    target, api = char_models["target"], client(base)
    texts = ["def fib(n):", "Once upon a time"]
    batch = [tokenizer.encode(t) for t in texts]
    answer = api.completions.create(model="tandem-tiny", prompt=texts, max_tokens=6, temperature=0,
                                    extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    for choice, ids in zip(answer.choices, batch):
        assert choice.prompt_token_ids == ids and choice.token_ids == reference_greedy(target, ids, 6)
        _assert_vllm_prompt_logprobs(choice.prompt_logprobs, ids, reference_logprobs(target, ids[:1], ids[1:]), 2)
        assert choice.logprobs is None  # the completion's were not asked
    alone = api.completions.create(model="tandem-tiny", prompt=texts[1], max_tokens=2, temperature=0,
                                   extra_body={"prompt_logprobs": 0}).choices[0]
    _assert_vllm_prompt_logprobs(alone.prompt_logprobs, batch[1], reference_logprobs(target, batch[1][:1],
                                                                                      batch[1][1:]), 0)
    assert getattr(alone, "prompt_token_ids", None) is None

    # With "echo" and "logprobs": 1, the echoed prompt keeps its own count (the token and one more).
    echoed = api.completions.create(model="tandem-tiny", prompt=texts[0], echo=True, max_tokens=0, logprobs=1,
                                    temperature=0, extra_body={"prompt_logprobs": 3}).choices[0]
    assert all(len(top) <= 2 for top in echoed.logprobs.top_logprobs[1:])
    assert max(len(entry) for entry in echoed.prompt_logprobs[1:]) == 4

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "count to five"}]
    templated = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                                 add_special_tokens=False)
    chat = api.chat.completions.create(model="tandem-tiny", messages=messages, max_tokens=8, temperature=0, n=2,
                                       extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    assert chat.prompt_token_ids == templated
    _assert_vllm_prompt_logprobs(chat.prompt_logprobs, templated,
                                 reference_logprobs(target, templated[:1], templated[1:]), 1)
    assert [c.token_ids for c in chat.choices] == [reference_greedy(target, templated, 8)] * 2

    chunks = list(api.completions.create(model="tandem-tiny", prompt=texts[0], max_tokens=6, temperature=0,
                                         stream=True, extra_body={"return_token_ids": True, "prompt_logprobs": 0}))
    carried = [c.choices[0].prompt_token_ids for c in chunks if getattr(c.choices[0], "prompt_token_ids", None)]
    assert carried == [batch[0]] and chunks[0].choices[0].prompt_token_ids == batch[0]
    chunks = list(api.chat.completions.create(model="tandem-tiny", messages=messages, max_tokens=4, temperature=0,
                                              stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].prompt_token_ids == templated
    assert [c for c in chunks[1:] if getattr(c, "prompt_token_ids", None)] == []

    for extra, words in (({"prompt_logprobs": 1}, "not available when 'stream' is true"),
                         ({"prompt_logprobs": -1}, "the whole vocabulary"),
                         ({"prompt_logprobs": 21}, "must be in"), ({"prompt_logprobs": True}, "an integer")):
        stream = "stream" in words
        with pytest.raises(openai.BadRequestError, match=words) as refused:
            api.completions.create(model="tandem-tiny", prompt=texts[0], max_tokens=2, stream=stream, extra_body=extra)
        assert refused.value.body["param"] == "prompt_logprobs"


def test_return_tokens_as_token_ids_names_each_logprob_token_by_its_id(http, char_models):
    """vLLM's return_tokens_as_token_ids: log probabilities name tokens
    "token_id:ID" (echoed prompt, completion, the likeliest, chat's bytes),
    the text and its offsets unchanged; --return-tokens-as-token-ids makes it
    the server's default, which a request may turn off."""
    cluster, base, tokenizer = http
    target = char_models["target"]
    prompt = "def fib(n):"
    ids = tokenizer.encode(prompt)
    expected = reference_greedy(target, ids, 6)
    body = dict(model="tandem-tiny", prompt=prompt, echo=True, max_tokens=6, logprobs=2, temperature=0)
    plain = client(base).completions.create(**body).choices[0]
    named = client(base).completions.create(**body, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert named.text == plain.text == prompt + tokenizer.decode(expected)
    assert named.logprobs.tokens == [f"token_id:{t}" for t in ids + expected]
    assert named.logprobs.text_offset == plain.logprobs.text_offset and named.logprobs.token_logprobs == \
        plain.logprobs.token_logprobs
    for top, plain_top in zip(named.logprobs.top_logprobs[1:], plain.logprobs.top_logprobs[1:]):
        assert {f"token_id:{tokenizer.convert_tokens_to_ids(t) if len(t) > 1 else ord(t)}": v
                for t, v in plain_top.items()} == top

    base_ids, stop = _gateway(cluster, "tandem-tiny", tokens_as_ids=True)  # the server's default
    try:
        messages = [{"role": "user", "content": "count to five"}]
        chat = client(base_ids).chat.completions.create(model="tandem-tiny", messages=messages, max_tokens=5,
                                                        temperature=0, logprobs=True, top_logprobs=1,
                                                        extra_body={"return_token_ids": True}).choices[0]
        for token_id, entry in zip(chat.token_ids, chat.logprobs.content):
            assert entry.token == f"token_id:{token_id}" and bytes(entry.bytes).decode() == entry.token
            assert all(alt.token.startswith("token_id:") for alt in entry.top_logprobs)
        again = client(base_ids).completions.create(**body, extra_body={"return_tokens_as_token_ids": False})
        assert again.choices[0].logprobs.tokens == plain.logprobs.tokens
    finally:
        stop()


def test_tokenize_detokenize_and_tokenizer_info_as_vllm_serves_them(http, char_models):
    """The endpoints lm-evaluation-harness's remote tokenizer and other vLLM
    clients use: the ids are the ones Generate would run, a conversation's
    those of its chat completion's prompt."""
    _, base, tokenizer = http

    def post(path: str, body: dict) -> dict:
        request = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            return json.load(reply)

    text = "def fib(n):"
    tokens = post("/tokenize", {"prompt": text, "add_special_tokens": False})
    assert tokens["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    assert post("/detokenize", {"tokens": tokens["tokens"]}) == {"prompt": tokenizer.decode(tokens["tokens"])}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    rendered = post("/tokenize", {"messages": messages})["tokens"]
    assert rendered == tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False,
                                                                      add_generation_prompt=True))
    chat = client(base).chat.completions.create(model="tandem-tiny", messages=messages, max_tokens=2, temperature=0)
    assert chat.usage.prompt_tokens == len(rendered)
    with urllib.request.urlopen(base + "/tokenizer_info", timeout=30) as reply:
        info = json.load(reply)
    assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] == 512
    assert info["pad_token"] == tokenizer.pad_token and info["tokenizer_class"]
    for path, body, words in [("/detokenize", {"tokens": ["a"]}, "'tokens' must be"),
                              ("/detokenize", {"tokens": [1, 999]}, "outside [0, 128)"),
                              ("/tokenize", {"prompt": 5}, "give 'prompt'"),
                              ("/tokenize", {"messages": []}, "'messages' must be a non-empty list")]:
        with pytest.raises(urllib.error.HTTPError) as caught:
            post(path, body)
        assert caught.value.code == 400 and words in json.load(caught.value)["error"]["message"], body


def test_logit_bias_and_min_tokens_reach_the_models(http, char_models):
    from tests.test_logit_bias import reference_biased

    _, base, tokenizer = http
    ids = tokenizer.encode("def fib(n):")
    plain = reference_greedy(char_models["target"], ids, 12)
    answer = client(base).completions.create(model="tandem-tiny", prompt=ids, max_tokens=12, temperature=0,
                                             logit_bias={str(plain[0]): -100}, extra_body={"return_token_ids": True})
    assert answer.choices[0].token_ids == reference_biased(char_models["target"], ids, 12, {plain[0]: -100.0})
    forced = client(base).chat.completions.create(model="tandem-tiny", messages=[{"role": "user", "content": "x"}],
                                                  max_tokens=6, logit_bias={"65": 100},
                                                  extra_body={"min_tokens": 2, "repetition_penalty": 1.1, "min_p": 0.1})
    assert forced.choices[0].message.content == "AAAAAA"


@pytest.mark.parametrize("kwargs, param, words", [
    (dict(temperature=-1), "temperature", "temperature"),
    (dict(n=17), "n", "'n' must be in [1, 16]"),
    (dict(frequency_penalty=2.5), "frequency_penalty", "in [-2, 2]"),
    (dict(extra_body={"min_p": 1.5}), "min_p", "in [0, 1]"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty", "repetition_penalty"),
    (dict(best_of=2), "best_of", "not supported"),
    (dict(extra_body={"logit_bias": {"5": 101}}), "logit_bias", "in [-100, 100]"),
    (dict(extra_body={"logit_bias": {"x": 1}}), "logit_bias", "maps token ids to numbers"),
    (dict(echo=True, suffix="x"), "suffix", "do not go together"),
    (dict(logprobs=21), "logprobs", "'logprobs' must be in [0, 20]"),
    (dict(extra_body={"top_logprobs": 2}), "top_logprobs", "a completion takes 'logprobs': N"),
    (dict(top_p=0), "top_p", "top_p"),
    (dict(max_tokens=0), "max_tokens", "max_tokens"),
    (dict(max_tokens=100_000), None, "context window"),  # the orchestrator's INVALID_ARGUMENT, passed on
    (dict(stop=["x", 5]), "stop", "'stop'"),
])
def test_bad_input_is_a_400_with_words(http, kwargs, param, words):
    _, base, _ = http
    with pytest.raises(openai.BadRequestError) as caught:
        client(base).completions.create(model="tandem-tiny", prompt="hi", **kwargs)
    error = caught.value.body
    assert caught.value.status_code == 400 and words in error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_other_errors_carry_openais_body_and_status(http):
    _, base, _ = http
    with pytest.raises(openai.NotFoundError) as caught:
        client(base).completions.create(model="gpt-4", prompt="hi")
    assert caught.value.body["code"] == "model_not_found" and "tandem-tiny" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="with a 'role'"):
        client(base).chat.completions.create(model="tandem-tiny", messages=[{"role": "", "content": "x"}])
    for body, words in [({"prompt": ["a"] * 65}, "at most 64 choices"), ({"prompt": [1, "a"]}, "list of token ids"),
                        ({"prompt": ["b", ["a"]]}, "'prompt[1]' must be"), ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "a", "echo": 1}, "'echo' must be true or false"),
                        ({"prompt": []}, "list of token ids"), ({"prompt": "hi", "stream_options": {}}, None),
                        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "'stream': true")]:
        request = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        if words is None:  # empty stream_options: nothing asked
            with urllib.request.urlopen(request, timeout=60) as reply:
                assert json.load(reply)["choices"][0]["finish_reason"]
            continue
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=30)
        assert caught.value.code == 400 and words in json.load(caught.value)["error"]["message"], body
    for path, data, status in [("/v1/completions", b"{not json", 400), ("/v1/completions", b"[1, 2]", 400),
                               ("/v1/chat/completions", b'{"messages": []}', 400), ("/v1/embeddings", b"{}", 404)]:
        request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=30)
        assert caught.value.code == status, path
        assert "message" in json.load(caught.value)["error"]


def test_a_client_that_goes_away_mid_stream_cancels_its_generation(http):
    """The generation stops within a few rounds, not at max_tokens: the target
    serves far fewer calls than the same request run to its end. Its session is
    deleted from Redis and both services (not parked for --prefix-cache), and
    the next request is served."""
    cluster, base, _ = http
    body = {"model": "tandem-tiny", "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0}
    before = cluster.target.calls
    client(base).completions.create(**body)
    whole = cluster.target.calls - before  # the target's calls for the whole request

    tenant = f"http-cancel-{time.time_ns()}"  # its own: it can take no other request's parked session
    store = redis.Redis.from_url(REDIS_URL)
    held = _settled_sessions(cluster)  # parked sessions of the tests before (--prefix-cache)
    request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json", "x-tandem-tenant": tenant})
    before = cluster.target.calls
    reply = urllib.request.urlopen(request, timeout=60)
    assert reply.readline().startswith(b"data: {")
    assert store.keys(f"tandem:{tenant}:*"), "the tenant header did not reach the orchestrator"
    reply.close()
    deadline = time.monotonic() + 30
    while (cluster.orchestrator.active_requests or store.keys(f"tandem:{tenant}:*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cluster.orchestrator.active_requests == 0 and not store.keys(f"tandem:{tenant}:*")
    cancelled = cluster.target.calls - before
    assert whole >= 40 and cancelled < whole / 4, (cancelled, whole)
    while cluster.run(_cached_sessions(cluster)) != held and time.monotonic() < deadline:
        time.sleep(0.01)  # the services' releases follow the store's delete
    assert cluster.run(_cached_sessions(cluster)) == held  # deleted, not parked
    answer = client(base).completions.create(model="tandem-tiny", prompt="hi", max_tokens=8, temperature=0)
    assert answer.usage.completion_tokens == 8


async def _cached_sessions(cluster) -> tuple[int, int]:
    return len(cluster.target.store), len(cluster.draft.store)


def _settled_sessions(cluster) -> tuple[int, int]:
    """The services' sessions once the requests before have ended and their
    sessions are parked (parking one past --prefix-cache's limit releases the
    oldest, a moment after the request's end)."""
    deadline, last = time.monotonic() + 30, None
    while time.monotonic() < deadline:
        now = cluster.run(_cached_sessions(cluster))
        if now == last and cluster.orchestrator.active_requests == 0:
            return now
        last = now
        time.sleep(0.2)
    raise AssertionError("the services' sessions did not settle")


def _wait_idle(cluster, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while cluster.orchestrator.active_requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cluster.orchestrator.active_requests == 0, "a generation went on after its request ended"


def test_an_orchestrator_at_its_request_limit_answers_429(char_models):
    """Past --max-concurrent-requests the orchestrator sheds a request with
    RESOURCE_EXHAUSTED, which the HTTP API reports as OpenAI's rate limit (429)."""
    cluster = Cluster(char_models["target"], char_models["draft"], max_concurrent_requests=1)
    base, stop = _gateway(cluster)
    try:
        model = client(base).models.list().data[0].id  # the target's id: no --served-model-name
        assert model == char_models["target"]
        held = client(base).completions.create(model=model, prompt="Once", max_tokens=400, temperature=0,
                                               stream=True)
        next(iter(held))  # the first request is being served
        with pytest.raises(openai.RateLimitError) as caught:
            client(base).completions.create(model=model, prompt="hi", max_tokens=4)
        assert caught.value.status_code == 429 and "--max-concurrent-requests" in caught.value.body["message"]
        held.close()
        _wait_idle(cluster)
        # Two choices past a limit of one: the second is refused, and the first,
        # admitted, is cancelled with it: the orchestrator is free again at once.
        for stream in (False, True):
            with pytest.raises(openai.RateLimitError):
                answer = client(base).completions.create(model=model, prompt="Once", max_tokens=400, temperature=0,
                                                         n=2, stream=stream)
                list(answer) if stream else None
            _wait_idle(cluster)
        assert client(base).completions.create(model=model, prompt="hi", max_tokens=4).usage.completion_tokens == 4
    finally:
        stop()
        cluster.stop()


def test_a_conversation_kept_as_a_session_is_continued_by_chat(http):
    """gRPC Generate with messages and keep_session: the session holds the
    conversation and the reply, so Chat continues it as if every turn had come
    through Chat, and only the new turn is prefilled."""
    cluster, _, _ = http
    params = dict(max_tokens=12, temperature=0.0)
    with cluster.client() as grpc_client:
        first = grpc_client.generate(messages=[{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": "hello"}], keep_session=True, **params)
        second = grpc_client.chat(first.session_id, "and again", **params)
        record = cluster.run(cluster.orchestrator.store.load("default", first.session_id))
        assert record.messages == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"},
                                   {"role": "assistant", "content": first.text},
                                   {"role": "user", "content": "and again"},
                                   {"role": "assistant", "content": second.text}]
        reference = grpc_client.create_session(system_prompt=SYSTEM)
        expected = [grpc_client.chat(reference, message, **params) for message in ("hello", "and again")]
        for session in (first.session_id, reference):
            assert grpc_client.delete_session(session)
    assert [first.token_ids, second.token_ids] == [r.token_ids for r in expected]
    assert second.stats.target_prefill_tokens == expected[1].stats.target_prefill_tokens  # the new turn only


def test_the_http_probe_sends_each_request_both_ways_and_gets_the_same_tokens(char_models, tmp_path):
    """bench.http_probe on the tiny pair: real processes, every way timed, the
    HTTP answers' tokens equal the gRPC API's."""
    from bench.http_probe import WAYS, main

    out = tmp_path / "http_probe.json"
    assert main(["--target", char_models["target"], "--draft", char_models["draft"], "--draft-args", "", "--dtype", "float32",
                 "--prompts", "code-1,prose-1", "--new-tokens", "12", "--reps", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for way in WAYS:
        row = result["modes"][way]
        assert row["requests"] == 4 and row["identical"] == 4 and row["tok_s"] > 0
        assert len(result["runs"][way]) == 4 and all(r["wall_s"] >= r["generation_s"] > 0 for r in result["runs"][way])


def test_a_reply_continues_the_assistants_last_message_when_asked(http, char_models):
    """vLLM's continue_final_message: the prompt is the template's text up to
    the end of the last message's content (HF's apply_chat_template with it),
    and the reply equals the target alone's continuation of that, over HTTP,
    /tokenize and gRPC."""
    import grpc

    cluster, base, tokenizer = http
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Well, it"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("assistant: Well, it") and text != tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    expected = reference_greedy(char_models["target"], prompt, 20)
    continuing = {"continue_final_message": True, "add_generation_prompt": False}
    answer = client(base).chat.completions.create(model="tandem-tiny", messages=messages, max_tokens=20, temperature=0,
                                                  extra_body={**continuing, "return_token_ids": True})
    assert answer.choices[0].token_ids == expected and answer.usage.prompt_tokens == len(prompt)
    request = urllib.request.Request(base + "/tokenize", data=json.dumps({"messages": messages, **continuing}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert json.load(reply)["tokens"] == prompt
    with cluster.client() as grpc_client:
        assert grpc_client.generate(messages=messages, max_tokens=20, continue_final_message=True).token_ids == expected
        with pytest.raises(grpc.RpcError) as refused:  # a session kept for Chat renders its turns without it
            grpc_client.generate(messages=messages, max_tokens=4, continue_final_message=True, keep_session=True)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "stateless" in refused.value.details()
    # The template's variables reach it; its own parameters are not variables.
    answer = client(base).chat.completions.create(model="tandem-tiny", messages=messages[:1], max_tokens=3,
                                                  temperature=0, extra_body={"chat_template_kwargs": {"unused": 1}})
    assert answer.usage.prompt_tokens == len(tokenizer.encode(tokenizer.apply_chat_template(
        messages[:1], tokenize=False, add_generation_prompt=True)))
    for extra, param, words in [
        ({"chat_template_kwargs": {"tokenize": True}}, None, "may not set tokenize"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "must be an object"),
        ({"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt", "false"),
        ({"add_generation_prompt": False}, "add_generation_prompt", "continue_final_message"),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            client(base).chat.completions.create(model="tandem-tiny", messages=messages, max_tokens=3,
                                                 extra_body=extra)
        assert words in refused.value.body["message"] and refused.value.body["param"] == param, refused.value.body


def test_chat_template_kwargs_are_the_templates_variables(char_models):
    from orchestrator.text import ChatTemplate

    tokenizer = AutoTokenizer.from_pretrained(char_models["target"])
    tokenizer.chat_template = "{% if brief %}brief: {% endif %}" + tokenizer.chat_template
    template = ChatTemplate(tokenizer)
    messages = [{"role": "user", "content": "hi"}]
    assert template.first_turn_text(messages, variables={"brief": True}) == "brief: user: hi\nassistant: "
    assert template.first_turn_text(messages) == "user: hi\nassistant: "
    assert template.first_turn_text([*messages, {"role": "assistant", "content": "Ho"}],
                                    continue_final_message=True) == "user: hi\nassistant: Ho"


def test_a_request_id_is_answered_named_in_the_answers_id_and_passed_to_the_orchestrator(http, recorded):
    """X-Request-Id: the client's comes back (whole, streamed, and on an
    error), names the completion, and reaches the orchestrator's span; one is
    made up where none (or an unusable one) is given."""
    from tests.test_telemetry import _wait_for

    _, base, _ = http
    spans, _ = recorded
    api = client(base, **{"X-Request-Id": "req-abc_123"})
    raw = api.completions.with_raw_response.create(model="tandem-tiny", prompt="abc", max_tokens=3, temperature=0)
    assert raw.headers["x-request-id"] == "req-abc_123" and raw.parse().id == "cmpl-req-abc_123"
    (generate,) = [s for s in _wait_for(spans, "tandem.v1.Tandem/Generate", 1) if s.name == "tandem.v1.Tandem/Generate"]
    assert generate.attributes["tandem.request_id"] == "req-abc_123"
    streamed = api.chat.completions.with_raw_response.create(
        model="tandem-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0, stream=True)
    assert streamed.headers["x-request-id"] == "req-abc_123"
    assert {chunk.id for chunk in streamed.parse()} == {"chatcmpl-req-abc_123"}
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(model="tandem-tiny", prompt="abc", max_tokens=0)
    assert refused.value.response.headers["x-request-id"] == "req-abc_123"
    for given in (None, "has spaces in it", "x" * 129):
        headers = {} if given is None else {"X-Request-Id": given}
        made = client(base, **headers).completions.with_raw_response.create(model="tandem-tiny", prompt="abc",
                                                                            max_tokens=2, temperature=0)
        made_id = made.headers["x-request-id"]
        assert made_id != given and len(made_id) == 32 and made.parse().id == f"cmpl-{made_id}"


def test_continuous_usage_stats_give_each_chunk_its_choices_usage_so_far(http):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): each
    chunk's usage counts the tokens its choice streamed so far, the last one's
    equal to the request's usage."""
    _, base, tokenizer = http
    prompt = "def fib(n):\n    "
    chunks = list(client(base).completions.create(
        model="tandem-tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True, n=2,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"return_token_ids": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 40  # both choices
    seen = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        seen[choice.index] += len(choice.token_ids or [])
        assert chunk.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert chunk.usage.completion_tokens == seen[choice.index]
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
    assert seen == {0: 20, 1: 20}
    plain = list(client(base).completions.create(model="tandem-tiny", prompt=prompt, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 5


def test_allowed_origins_answer_a_browsers_preflight_and_no_others(http):
    """--allowed-origins: a page of an allowed origin may call the API (the
    preflight is answered, the answer names the origin); another origin, or a
    gateway without the flag, gets no CORS headers."""
    cluster, closed_base, _ = http
    open_base, stop_open = _gateway(cluster, "tandem-tiny", allowed_origins=("https://chat.example.com",))
    try:
        def preflight(base: str, origin: str):
            request = urllib.request.Request(f"{base}/v1/chat/completions", method="OPTIONS", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type"})
            try:
                with urllib.request.urlopen(request, timeout=30) as reply:
                    return reply.status, reply.headers
            except urllib.error.HTTPError as err:
                return err.code, err.headers

        status, headers = preflight(open_base, "https://chat.example.com")
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "https://chat.example.com"
        assert "POST" in headers["Access-Control-Allow-Methods"]
        assert "AUTHORIZATION" in headers["Access-Control-Allow-Headers"].upper()
        for base, origin in ((open_base, "https://evil.example.net"), (closed_base, "https://chat.example.com")):
            status, headers = preflight(base, origin)
            assert status >= 400 and "Access-Control-Allow-Origin" not in headers, (base, origin)
        request = urllib.request.Request(f"{open_base}/v1/models", headers={"Origin": "https://chat.example.com"})
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert reply.headers["Access-Control-Allow-Origin"] == "https://chat.example.com"
            assert "X-Request-Id" in reply.headers["Access-Control-Expose-Headers"]
    finally:
        stop_open()


def test_allowed_token_ids_and_bad_words_reach_the_models_as_on_grpc(http):
    cluster, base, tokenizer = http
    prompt = "def fib(n):\n    "
    allowed = tokenizer.encode("abc ", add_special_tokens=False)
    with cluster.client() as grpc_client:
        masked = grpc_client.generate(prompt, max_tokens=12, allowed_token_ids=allowed)
        banned = grpc_client.generate(prompt, max_tokens=12, bad_words=["I", "%"])
    assert set(masked.token_ids) <= set(allowed)
    api = client(base)
    answer = api.completions.create(model="tandem-tiny", prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    assert answer.choices[0].token_ids == masked.token_ids
    answer = api.completions.create(model="tandem-tiny", prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"bad_words": ["I", "%"], "return_token_ids": True})
    assert answer.choices[0].token_ids == banned.token_ids and not {"I", "%"} & set(answer.choices[0].text)
    for body, param in (({"allowed_token_ids": ["a"]}, "allowed_token_ids"), ({"bad_words": [3]}, "bad_words")):
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(model="tandem-tiny", prompt=prompt, max_tokens=2, extra_body=body)
        assert refused.value.body["param"] == param


def test_a_models_card_the_version_and_the_ping_probe(http):
    cluster, base, _ = http
    api = client(base)
    card = api.models.retrieve("tandem-tiny")
    with cluster.client() as grpc_client:
        info = grpc_client.server_info()
    assert card.id == "tandem-tiny" and card.model_dump()["max_model_len"] == info.max_context
    assert api.models.list().data[0].model_dump() == card.model_dump()
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("gpt-4o")
    with urllib.request.urlopen(f"{base}/version", timeout=30) as reply:
        assert json.load(reply)["version"] == importlib.metadata.version("tandem")
    for method in ("GET", "POST"):
        with urllib.request.urlopen(urllib.request.Request(f"{base}/ping", method=method), timeout=30) as reply:
            assert reply.status == 200 and json.load(reply)["status"] == "ok"


def test_http_requests_are_counted_by_route_and_status(http, recorded):
    from tests.test_telemetry import _points

    _, base, _ = http
    _, reader = recorded
    api = client(base)
    api.completions.create(model="tandem-tiny", prompt="abc", max_tokens=2, temperature=0)
    list(api.completions.create(model="tandem-tiny", prompt="abc", max_tokens=2, temperature=0, stream=True))
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model="tandem-tiny", prompt="abc", max_tokens=0)
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(f"{base}/v1/nothing", timeout=30)
    api.models.retrieve("tandem-tiny")
    points = _points(reader)
    counted = {tuple(sorted(attributes)): point.value for attributes, point in points["tandem.http.requests"].items()}
    assert counted == {
        (("method", "POST"), ("route", "/v1/completions"), ("status", 200)): 2,
        (("method", "POST"), ("route", "/v1/completions"), ("status", 400)): 1,
        (("method", "GET"), ("route", "unmatched"), ("status", 404)): 1,
        (("method", "GET"), ("route", "/v1/models/{model}"), ("status", 200)): 1,
    }
    timed = points["tandem.http.duration"][frozenset({("method", "POST"), ("route", "/v1/completions")})]
    assert timed.count == 3 and timed.sum > 0


def test_each_turn_of_a_conversation_resent_at_once_reuses_the_one_before(http):
    """The gateway answers as soon as the orchestrator's final event comes; the
    orchestrator parks the session before it sends that event, so a client that
    sends the next turn at once always finds the last one parked (--prefix-cache)."""
    import asyncio

    cluster, base, tokenizer = http
    cache = cluster.orchestrator.prefix_cache

    async def slow_park(record):  # a Redis under load: parking takes a while
        await asyncio.sleep(0.2)
        return await type(cache).park(cache, record)

    cache.park = slow_park
    messages = [{"role": "system", "content": SYSTEM + " Keep to one line of code."}]
    tenant = {"x-tandem-tenant": f"turns-{uuid.uuid4().hex[:8]}"}
    try:
        for turn in range(4):
            messages.append({"role": "user", "content": f"step {turn}: print {turn}"})
            answer = client(base, **tenant).chat.completions.create(
                model="tandem-tiny", messages=messages, max_tokens=6, temperature=0)
            if turn:
                cached = answer.usage.prompt_tokens_details.cached_tokens
                last_prompt = tokenizer.apply_chat_template(messages[:-2], tokenize=False, add_generation_prompt=True)
                assert cached >= len(tokenizer.encode(last_prompt)), (turn, cached)  # the turn before, at least
            messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    finally:
        del cache.park
