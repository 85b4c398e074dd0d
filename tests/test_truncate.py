"""truncate_prompt_tokens (vLLM's): a prompt cut to its last n tokens, or
with -1 to as many as fit beside max_tokens, runs as that cut prompt would
alone: the same tokens as the target alone on it, its usage and echo those of
the cut prompt. End to end over real gRPC and HTTP with the character pair
(a token a character, a context window of 512)."""
import grpc
import pytest

from tests.conftest import reference_greedy
from tests.test_http_api import client, http  # noqa: F401 (fixture)

PROMPT = "Tell me a story about a cat that sat on a mat, then a dog. "
CONTEXT = 512


def test_a_cut_prompt_generates_what_its_last_tokens_give_the_target_alone(http, char_models):  # noqa: F811
    cluster, _, tokenizer = http
    ids = tokenizer.encode(PROMPT)
    expected = reference_greedy(char_models["target"], ids[-9:], 24)
    with cluster.client() as grpc_client:
        cut = grpc_client.generate(PROMPT, max_tokens=24, truncate_prompt_tokens=9, echo=True, ignore_eos=True)
        assert cut.token_ids == expected and cut.prompt_tokens == 9
        assert list(cut.prompt.token_ids) == ids[-9:] and cut.prompt.text == tokenizer.decode(ids[-9:])
        # More than the prompt holds: the whole prompt.
        whole = grpc_client.generate(PROMPT, max_tokens=8, truncate_prompt_tokens=10_000, ignore_eos=True)
        assert whole.prompt_tokens == len(ids)
        # -1: a prompt past the context window keeps what fits beside max_tokens.
        long = PROMPT * 12
        assert len(tokenizer.encode(long)) + 16 > CONTEXT
        with pytest.raises(grpc.RpcError) as err:
            grpc_client.generate(long, max_tokens=16)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context window" in err.value.details()
        fitted = grpc_client.generate(long, max_tokens=16, truncate_prompt_tokens=-1, ignore_eos=True)
        assert fitted.prompt_tokens == CONTEXT - 16
        assert fitted.token_ids == reference_greedy(char_models["target"], tokenizer.encode(long)[-(CONTEXT - 16):], 16)


@pytest.mark.parametrize("how", ["zero", "below -1", "keep_session", "fill", "chat", "no room"])
def test_truncation_that_cannot_apply_is_invalid(http, how):  # noqa: F811
    cluster, _, _ = http
    with cluster.client() as grpc_client, pytest.raises(grpc.RpcError) as err:
        if how == "zero":
            grpc_client.generate(PROMPT, max_tokens=4, truncate_prompt_tokens=0)
        elif how == "below -1":
            grpc_client.generate(PROMPT, max_tokens=4, truncate_prompt_tokens=-2)
        elif how == "keep_session":
            grpc_client.generate(PROMPT, max_tokens=4, truncate_prompt_tokens=5, keep_session=True)
        elif how == "fill":
            grpc_client.generate(PROMPT, suffix="end", max_tokens=4, truncate_prompt_tokens=5)
        elif how == "chat":
            session = grpc_client.create_session()
            grpc_client.chat(session, "hi", max_tokens=4, truncate_prompt_tokens=5)
        else:
            grpc_client.generate(PROMPT, max_tokens=CONTEXT, truncate_prompt_tokens=-1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("leaves no room for a prompt" if how == "no room" else "truncate_prompt_tokens") in err.value.details()


def test_over_http_a_cut_prompt_is_echoed_and_counted_as_cut(http, char_models):  # noqa: F811
    import openai

    cluster, base, tokenizer = http
    api = client(base)
    ids = tokenizer.encode(PROMPT)
    expected = tokenizer.decode(reference_greedy(char_models["target"], ids[-12:], 20))
    answer = api.completions.create(model="tandem-tiny", prompt=PROMPT, max_tokens=20, temperature=0, echo=True,
                                    extra_body={"truncate_prompt_tokens": 12, "ignore_eos": True})
    assert answer.choices[0].text == tokenizer.decode(ids[-12:]) + expected
    assert answer.usage.prompt_tokens == 12
    messages = [{"role": "user", "content": PROMPT}]
    chat = api.chat.completions.create(model="tandem-tiny", messages=messages, max_tokens=8, temperature=0,
                                       extra_body={"truncate_prompt_tokens": 7})
    assert chat.usage.prompt_tokens == 7
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model="tandem-tiny", prompt=PROMPT, max_tokens=4,
                               extra_body={"truncate_prompt_tokens": 0})
    assert err.value.body["param"] == "truncate_prompt_tokens"
