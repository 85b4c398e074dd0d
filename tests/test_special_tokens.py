"""skip_special_tokens (vLLM's; default true): the text leaves the
tokenizer's special tokens out, or with false keeps them; the token ids are
the same either way, and stop strings are found in the text the client gets.
End to end over real gRPC and HTTP with the character pair, whose
end-of-sequence token (\\x03) is special."""
import pytest

from tests.test_http_api import client
from tests.test_structured import EOS, cluster, models  # noqa: F401 (fixtures)


def _mixed(grpc_client, prompt: str, n: int):
    """Greedy ids past the end token (ignore_eos) with a bias towards it that
    makes the answer hold it among other tokens."""
    for bias in (2.0, 3.0, 4.0, 1.0, 5.0, 6.0):
        result = grpc_client.generate(prompt, max_tokens=n, ignore_eos=True, logit_bias={EOS: bias})
        if EOS in result.token_ids and any(t != EOS for t in result.token_ids):
            return bias, result
    pytest.skip("no bias gave an answer that mixes the end token with others")


def test_special_tokens_are_left_out_of_the_text_unless_asked(cluster, models):  # noqa: F811
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["target"])
    assert EOS in tokenizer.all_special_ids
    prompt, n = "A: ", 24
    with cluster.client() as grpc_client:
        bias, plain = _mixed(grpc_client, prompt, n)
        kept = grpc_client.generate(prompt, max_tokens=n, ignore_eos=True, logit_bias={EOS: bias},
                                    skip_special_tokens=False)
        assert kept.token_ids == plain.token_ids
        assert plain.text == tokenizer.decode(plain.token_ids, skip_special_tokens=True) and chr(EOS) not in plain.text
        assert kept.text == tokenizer.decode(kept.token_ids, skip_special_tokens=False)
        assert kept.text.count(chr(EOS)) == plain.token_ids.count(EOS)
        streamed = "".join(e.delta.text for e in grpc_client.generate_stream(
            prompt, max_tokens=n, ignore_eos=True, logit_bias={EOS: bias}, skip_special_tokens=False)
            if e.HasField("delta"))
        assert streamed == kept.text
        # A stop string is looked for in the text the client gets: the end token's character
        # stops a request that keeps it, and not one that leaves it out.
        first = kept.token_ids.index(EOS)
        stopped = grpc_client.generate(prompt, max_tokens=n, ignore_eos=True, logit_bias={EOS: bias},
                                       skip_special_tokens=False, stop=[chr(EOS)])
        assert stopped.finish_reason == "stop" and stopped.token_ids == kept.token_ids[:first + 1]
        assert stopped.text == kept.text[:kept.text.index(chr(EOS))]
        unstopped = grpc_client.generate(prompt, max_tokens=n, ignore_eos=True, logit_bias={EOS: bias},
                                         stop=[chr(EOS)])
        assert unstopped.finish_reason == "length" and unstopped.token_ids == plain.token_ids


def test_over_http_skip_special_tokens_false_keeps_them(cluster):  # noqa: F811
    from tests.test_http_api import _gateway

    base, stop = _gateway(cluster, "tandem-tiny")
    try:
        with cluster.client() as grpc_client:
            bias, plain = _mixed(grpc_client, "A: ", 24)
        api = client(base)
        answers = {skip: api.completions.create(
            model="tandem-tiny", prompt="A: ", max_tokens=24, temperature=0,
            logit_bias={str(EOS): bias}, extra_body={"ignore_eos": True, "skip_special_tokens": skip})
            for skip in (True, False)}
        assert answers[True].choices[0].text == plain.text
        assert answers[False].choices[0].text.count(chr(EOS)) == plain.token_ids.count(EOS) > 0
    finally:
        stop()
