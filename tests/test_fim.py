"""Fill in the middle (OpenAI's completions `suffix`, the gRPC API's
FillInTheMiddle, `tandem generate --suffix`): the prompt is the prefix and the
suffix between the model's sentinel tokens, and the completion equals the
target alone's greedy continuation of it."""
import shutil

import grpc
import openai
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from orchestrator import fim
from tests.conftest import TINY_VOCAB, Cluster, reference_greedy
from tests.test_http_api import _gateway, client, http  # noqa: F401 (http: a cluster whose tokenizer has no sentinels)

SENTINELS = fim.FORMATS["qwen"]
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"


def _fim_tokenizer(path) -> None:
    """The character tokenizer with Qwen's three sentinels and its end of text
    in place of the control characters 4-7, so that the tiny models' 128 ids
    still cover it."""
    special = [*SENTINELS, "<|endoftext|>"]
    vocab = {chr(i): i for i in range(TINY_VOCAB) if i not in (4, 5, 6, 7)}
    vocab.update({token: 4 + i for i, token in enumerate(special)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(special)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="?", pad_token=chr(0)).save_pretrained(path)


@pytest.fixture(scope="module")
def fim_cluster(char_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("fim")
    paths = {}
    for name in ("target", "draft"):
        paths[name] = root / name
        shutil.copytree(char_models[name], paths[name])
        for stale in paths[name].glob("tokenizer*"):
            stale.unlink()
        _fim_tokenizer(paths[name])
    cluster = Cluster(str(paths["target"]), str(paths["draft"]))
    base, stop = _gateway(cluster, "tandem-tiny")
    yield cluster, base, str(paths["target"])
    stop()
    cluster.stop()


def test_the_format_is_read_from_the_vocabulary(tmp_path):
    _fim_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert fim.detect(tokenizer) == "qwen" and fim.detect(None) is None
    text = fim.prompt("qwen", PREFIX, SUFFIX)
    assert text == f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == 4 and ids.count(5) == ids.count(6) == 1 and ids[-1] == 6  # each sentinel one token
    assert fim.end_ids(tokenizer) == {4, 5, 6, 7}  # the sentinels and the end of text end a middle
    assert fim.detect(PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0}, unk_token="a")))) \
        is None


def test_a_filled_in_middle_equals_the_target_alone(fim_cluster):
    cluster, base, target = fim_cluster
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompt = tokenizer.encode(fim.prompt("qwen", PREFIX, SUFFIX), add_special_tokens=False)
    expected = reference_greedy(target, prompt, 16)  # (its 21st token is a near-tie, 3e-6 apart, in float32)
    with cluster.client() as grpc_client:
        assert grpc_client.server_info().fim_format == "qwen"
        result = grpc_client.generate(PREFIX, suffix=SUFFIX, max_tokens=16)
        assert result.token_ids == expected and result.prompt_tokens == len(prompt)
    api = client(base)
    answer = api.completions.create(model="tandem-tiny", prompt=PREFIX, suffix=SUFFIX, max_tokens=16, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert answer.choices[0].token_ids == expected and answer.choices[0].text == tokenizer.decode(expected)
    streamed = list(api.completions.create(model="tandem-tiny", prompt=PREFIX, suffix=SUFFIX, max_tokens=16,
                                           temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == tokenizer.decode(expected)
    # Two prompts, one suffix: each filled in as alone.
    batch = api.completions.create(model="tandem-tiny", prompt=[PREFIX, "x = "], suffix=SUFFIX, max_tokens=8,
                                   temperature=0, extra_body={"return_token_ids": True})
    assert batch.choices[0].token_ids == expected[:8]
    # The middle ends at the model's end of text (Qwen2.5-Coder writes it; its instruct models' end of
    # sequence is another token), here forced first by a logit bias; a plain completion goes on past it.
    ended = api.completions.create(model="tandem-tiny", prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0,
                                   logit_bias={"7": 100}, extra_body={"return_token_ids": True})
    assert ended.choices[0].token_ids == [7] and ended.choices[0].finish_reason == "stop"
    plain = api.completions.create(model="tandem-tiny", prompt=PREFIX, max_tokens=8, temperature=0,
                                   logit_bias={"7": 100}, extra_body={"return_token_ids": True})
    assert plain.choices[0].token_ids == [7] * 8 and plain.choices[0].finish_reason == "length"
    for bad, words in [({"prompt": [1, 2, 3]}, "text prompts"), ({"echo": True}, "'echo'"), ({"suffix": 5}, "string")]:
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(model="tandem-tiny", **{"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 4, **bad})
        assert words in refused.value.body["message"] and refused.value.body["param"] == "suffix"


def test_a_model_without_sentinels_cannot_fill_in(http):
    cluster, base, _ = http
    with cluster.client() as grpc_client:
        assert grpc_client.server_info().fim_format == ""
        with pytest.raises(grpc.RpcError) as refused:
            grpc_client.generate(PREFIX, suffix=SUFFIX, max_tokens=4)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "no fill-in-the-middle tokens" in refused.value.details()
    with pytest.raises(openai.BadRequestError):
        client(base).completions.create(model="tandem-tiny", prompt=PREFIX, suffix=SUFFIX, max_tokens=4)

