"""logit_bias, min_tokens and the presence and frequency penalties: each
changes the distribution the target decodes from, on both services alike
(tandem.distributions.adjust_logits). Greedy output equals Hugging Face's
generate on the target alone with the same processing; sampled output keeps
to the adjusted distribution."""
import grpc
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper)

from tandem.distributions import adjust_logits, logits_to_probs
from tandem.sampling import SamplingParams
from tests.conftest import Cluster, reference_greedy
from tests.test_end_tokens import N, PROMPT, ending  # noqa: F401 (a fixture)

PROMPTS = ([3, 1, 4, 1, 5, 9, 2, 6], [10, 20, 30, 40, 50, 60, 10, 20])


class Bias(LogitsProcessor):
    def __init__(self, bias: dict[int, float]):
        self.bias = bias

    def __call__(self, input_ids, scores):
        for token, value in self.bias.items():
            scores[:, token] += value
        return scores


class Penalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the generated tokens."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        for row, ids in enumerate(input_ids):
            counts = torch.bincount(ids[self.prompt_len:], minlength=scores.shape[-1]).float()
            scores[row] -= self.frequency * counts + self.presence * (counts > 0).float()
        return scores


def reference_processed(model_dir: str, prompt: list[int], n: int, *processors) -> list[int]:
    """Hugging Face generate(do_sample=False) on the target alone, with the processors."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList(processors))
    return out[0, len(prompt):].tolist()


def reference_biased(model_dir: str, prompt: list[int], n: int, bias: dict[int, float]) -> list[int]:
    return reference_processed(model_dir, prompt, n, Bias(bias))


def test_adjust_logits_biases_every_row_and_suppresses_by_position():
    logits = torch.zeros(3, 6)
    params = SamplingParams(logit_bias=((1, 2.0), (4, -1.5), (9, 5.0)), suppress_ids=(0, 5), suppress_before=11)
    out = adjust_logits(logits, params, first_position=10)  # rows at positions 10, 11, 12
    assert out[:, 1].tolist() == [2.0] * 3 and out[:, 4].tolist() == [-1.5] * 3  # id 9: past the vocabulary
    assert out[0, 0] == out[0, 5] == float("-inf") and out[1:, [0, 5]].eq(0).all()
    assert torch.equal(logits, torch.zeros(3, 6))  # the input is left as it was
    assert adjust_logits(logits, SamplingParams(), 0) is logits
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, suppress_ids=(2,), suppress_before=1), 0)
    assert probs[0, 2] == 0 and probs[1, 2] > 0
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias=((3, 101.0),))


def test_penalties_count_the_completion_before_each_row():
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 12, (40,), generator=generator).tolist()
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4, penalty_start=10)
    logits = torch.randn(5, 12, generator=generator)
    out = adjust_logits(logits, params, first_position=36, tokens=tokens)  # rows at positions 36..40
    for i in range(5):
        counts = torch.bincount(torch.tensor(tokens[10:36 + i]), minlength=12).float()
        expected = logits[i] - 0.7 * (counts > 0).float() + 0.4 * counts
        torch.testing.assert_close(out[i], expected)


def test_the_repetition_penalty_and_min_p_are_hugging_faces():
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 50, (30,), generator=generator).tolist()
    logits = torch.randn(4, 50, generator=generator) * 3
    out = adjust_logits(logits, SamplingParams(repetition_penalty=1.3), first_position=27, tokens=tokens)
    probs = logits_to_probs(logits, SamplingParams(temperature=0.7, min_p=0.2))
    for i in range(4):
        expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([tokens[:27 + i]]), logits[i:i + 1].clone())
        torch.testing.assert_close(out[i], expected[0])
        warped = MinPLogitsWarper(0.2)(None, TemperatureLogitsWarper(0.7)(None, logits[i:i + 1].clone()))
        torch.testing.assert_close(probs[i], warped.softmax(-1)[0])
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0.0)


@pytest.fixture(scope="module")
def cluster(tiny_models, near_draft):
    cluster = Cluster(tiny_models["target"], near_draft, tree_width=4, target_graphs="off")
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "sequential"])
def test_greedy_with_a_logit_bias_equals_the_target_alone_with_it(cluster, tiny_models, pipeline):
    target = tiny_models["target"]
    with cluster.client() as client:
        for prompt in PROMPTS:
            plain = reference_greedy(target, prompt, 24)
            # Ban the target's first two tokens and favour one it did not pick.
            bias = {plain[0]: -100.0, plain[1]: -100.0, 77: 3.0}
            expected = reference_biased(target, prompt, 24, bias)
            assert expected != plain and plain[0] not in expected
            result = client.generate(prompt_ids=prompt, max_tokens=24, logit_bias=bias, pipeline=pipeline,
                                     num_draft_tokens=3)
            assert result.token_ids == expected


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "sequential"])
def test_greedy_with_penalties_equals_the_target_alone_with_them(cluster, tiny_models, pipeline):
    """Penalties count the completion's tokens before each position, drafted
    ones within a block included: a draft token is scored after the ones
    before it in its block."""
    target = tiny_models["target"]
    with cluster.client() as client:
        for prompt, presence, frequency in ((PROMPTS[0], 0.8, 0.6), (PROMPTS[1], -0.5, 1.5)):
            expected = reference_processed(target, prompt, 32, Penalties(len(prompt), presence, frequency))
            assert expected != reference_greedy(target, prompt, 32)
            result = client.generate(prompt_ids=prompt, max_tokens=32, presence_penalty=presence,
                                     frequency_penalty=frequency, pipeline=pipeline, num_draft_tokens=3)
            assert result.token_ids == expected
        # Sampled, a seed gives the same tokens with the pipeline on and off.
        runs = [client.generate(prompt_ids=PROMPTS[0], max_tokens=32, temperature=0.8, seed=6, presence_penalty=1.0,
                                frequency_penalty=0.5, pipeline=p) for p in (True, False)]
        assert runs[0].token_ids == runs[1].token_ids


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "sequential"])
def test_a_draft_that_is_the_target_adjusts_alike_and_is_always_accepted(same_cluster, tiny_models, pipeline):
    """With the target as its own draft, every drafted token holds only if the
    draft applies the same bias and penalties at the same positions as the
    target."""
    target = tiny_models["target"]
    prompt = PROMPTS[0]
    bias = {reference_greedy(target, prompt, 1)[0]: -100.0, 77: 2.0}
    expected = reference_processed(target, prompt, 32, RepetitionPenaltyLogitsProcessor(1.2), Bias(bias),
                                   Penalties(len(prompt), 0.7, 0.9))
    with same_cluster.client() as client:
        result = client.generate(prompt_ids=prompt, max_tokens=32, logit_bias=bias, presence_penalty=0.7,
                                 frequency_penalty=0.9, repetition_penalty=1.2, pipeline=pipeline, num_draft_tokens=4)
    assert result.token_ids == expected
    assert result.stats.drafted_tokens > 16 and result.stats.accepted_tokens == result.stats.drafted_tokens


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "sequential"])
def test_greedy_with_a_repetition_penalty_equals_hugging_faces(cluster, tiny_models, pipeline):
    target = tiny_models["target"]
    with cluster.client() as client:
        for prompt in PROMPTS:
            expected = reference_processed(target, prompt, 32, RepetitionPenaltyLogitsProcessor(1.4))
            assert expected != reference_greedy(target, prompt, 32)
            result = client.generate(prompt_ids=prompt, max_tokens=32, repetition_penalty=1.4, pipeline=pipeline)
            assert result.token_ids == expected
        # min_p 1 keeps only the likeliest token: sampling then gives the greedy output.
        sampled = client.generate(prompt_ids=PROMPTS[0], max_tokens=32, temperature=1.0, seed=8, min_p=1.0,
                                  pipeline=pipeline)
        assert sampled.token_ids == reference_greedy(target, PROMPTS[0], 32)
        with pytest.raises(grpc.RpcError) as caught:
            client.generate(prompt_ids=PROMPTS[0], max_tokens=4, repetition_penalty=-1.0)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_sampling_keeps_to_the_biased_distribution(cluster):
    with cluster.client() as client:
        favoured = client.generate(prompt_ids=PROMPTS[0], max_tokens=24, temperature=1.0, seed=4,
                                   logit_bias={42: 100.0})
        assert favoured.token_ids == [42] * 24  # e^100 against the rest: never anything else
        unbiased = client.generate(prompt_ids=PROMPTS[0], max_tokens=32, temperature=1.0, seed=4)
        banned = set(unbiased.token_ids)
        again = client.generate(prompt_ids=PROMPTS[0], max_tokens=32, temperature=1.0, seed=4,
                                logit_bias={t: -100.0 for t in banned})
        assert not banned & set(again.token_ids) and len(again.token_ids) == 32
        for bias, words in [({500: 1.0}, "outside [0, 128)"), ({1: 101.0}, "[-100, 100]")]:
            with pytest.raises(grpc.RpcError) as caught:
                client.generate(prompt_ids=PROMPTS[0], max_tokens=4, logit_bias=bias)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in caught.value.details()


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "sequential"])
def test_min_tokens_keeps_the_end_of_sequence_out_as_min_new_tokens_does(ending, pipeline):  # noqa: F811
    """The target ends at its end-of-sequence token; with min_tokens past it,
    it decodes on as Hugging Face's generate(min_new_tokens) does."""
    cluster, expected, eos_at, _ = ending
    model_dir = cluster.params["target_dir"]
    eos = expected[eos_at]
    minimum = eos_at + 4
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = torch.tensor([PROMPT])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=minimum,
                             do_sample=False, pad_token_id=0, eos_token_id=eos)
    reference = out[0, len(PROMPT):].tolist()
    if eos in reference:
        reference = reference[: reference.index(eos) + 1]
    assert eos not in reference[:minimum] and len(reference) > eos_at + 1
    with cluster.client() as client:
        result = client.generate(prompt_ids=PROMPT, max_tokens=N, min_tokens=minimum, pipeline=pipeline)
        assert result.token_ids == reference
        assert result.finish_reason == ("eos" if reference[-1] == eos else "length")
        # The end of sequence favoured far above all else comes right after the
        # min_tokens, greedy or sampled: not before, not later.
        for temperature in (0.0, 1.0):
            pushed = client.generate(prompt_ids=PROMPT, max_tokens=N, min_tokens=6, temperature=temperature, seed=1,
                                     logit_bias={eos: 100.0}, pipeline=pipeline)
            assert (pushed.finish_reason, len(pushed.token_ids), pushed.token_ids[-1]) == ("eos", 7, eos)
        with pytest.raises(grpc.RpcError) as caught:
            client.generate(prompt_ids=PROMPT, max_tokens=4, min_tokens=5)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_tokens" in caught.value.details()


def test_sampled_tokens_follow_the_adjusted_target_distribution(random_cluster, tiny_models):
    """End to end, under sampling with an unrelated draft (most drafted tokens
    rejected, so the second token comes from the accept rule and its residual
    draws): the second generated token's frequencies over many seeds match
    its exact marginal under the target's adjusted distribution, where the
    first token's presence and frequency penalty applies to the second."""
    from scipy.stats import chisquare

    prompt, n = PROMPTS[1], 1200
    model = AutoModelForCausalLM.from_pretrained(tiny_models["target"], dtype=torch.float32).eval()
    with torch.inference_mode():
        plain = model(torch.tensor([prompt])).logits[0, -1]
    # A bias that makes token 5 the first token 9 times in 10; the penalties then
    # weigh on it as the second (without them it would come second as often).
    others = torch.cat([plain[:5], plain[6:]])
    bias = {5: round(float(torch.log(torch.tensor(9.0)) + torch.logsumexp(others, 0) - plain[5]), 3), 9: -3.0}
    params = SamplingParams(temperature=1.0, logit_bias=tuple(sorted(bias.items())), presence_penalty=2.0,
                            frequency_penalty=2.0, penalty_start=len(prompt), repetition_penalty=1.2, min_p=0.01)
    with torch.inference_mode():
        first = logits_to_probs(model(torch.tensor([prompt])).logits[0, -1:], params, len(prompt), prompt)[0]
        seconds = torch.stack([
            logits_to_probs(model(torch.tensor([prompt + [x]])).logits[0, -1:], params, len(prompt) + 1,
                            prompt + [x])[0] for x in range(first.shape[0])])
    exact = (first[:, None] * seconds).sum(0).double().numpy()
    exact /= exact.sum()
    counts = np.zeros(len(exact))
    accepted = 0
    with random_cluster.client() as client:
        for seed in range(n):
            # Three tokens: the second drafted (with two, the second round would
            # have no room for a draft token, and the target alone would draw it).
            result = client.generate(prompt_ids=prompt, max_tokens=3, temperature=1.0, seed=seed,
                                     logit_bias=bias, presence_penalty=2.0, frequency_penalty=2.0,
                                     repetition_penalty=1.2, min_p=0.01,
                                     num_draft_tokens=2)
            counts[result.token_ids[1]] += 1
            accepted += result.stats.accepted_tokens
    assert 0 < accepted < n / 2  # mostly rejections: the residual draws are tested, not the draft's
    expected = exact * n
    big = expected >= 5  # the rest in one bin
    observed = np.append(counts[big], counts[~big].sum())
    assert chisquare(observed, np.append(expected[big], expected[~big].sum())).pvalue > 1e-3
    # Without the penalties on the target's side, token 5 would come second this often instead:
    assert abs(counts[5] / n - exact[5]) < 0.05 and exact[5] < 0.5 < first[5]


# --- allowed_token_ids and bad_words ------------------------------------------------------

class AllowOnly(LogitsProcessor):
    def __init__(self, allowed: list[int]):
        self.allowed = allowed

    def __call__(self, input_ids, scores):
        masked = torch.full_like(scores, float("-inf"))
        masked[:, self.allowed] = scores[:, self.allowed]
        return masked


class BadWords(LogitsProcessor):
    """vLLM's bad_words as token sequences, over the generated tokens only."""

    def __init__(self, prompt_len: int, words: list[list[int]]):
        self.prompt_len, self.words = prompt_len, words

    def __call__(self, input_ids, scores):
        for row, ids in enumerate(input_ids.tolist()):
            generated = ids[self.prompt_len:]
            for word in self.words:
                before = word[:-1]
                if len(generated) >= len(before) and generated[len(generated) - len(before):] == before:
                    scores[row, word[-1]] = float("-inf")
        return scores


def test_allowed_ids_and_bad_words_mask_by_position():
    logits = torch.arange(12, dtype=torch.float32).repeat(4, 1)  # rows at positions 20..23
    tokens = [0] * 20 + [6, 7, 5]  # the prompt's zeros, then the completion from position 20 on: 6 7 5
    out = adjust_logits(logits, SamplingParams(allowed_ids=(2, 7, 30)), 20, tokens)  # 30: past the vocabulary
    assert torch.isinf(out[:, [0, 1, 3, 4, 5, 6, 8, 9, 10, 11]]).all() and out[:, [2, 7]].eq(logits[:, [2, 7]]).all()
    banned = adjust_logits(logits, SamplingParams(bad_words=((6, 7, 9), (3,), (0, 4)), penalty_start=20), 20, tokens)
    # row 2 (position 22) follows 6 7: its 9 is banned, and no other row's
    assert torch.isinf(banned[2, 9]) and not torch.isinf(banned[[0, 1, 3], 9]).any()
    assert torch.isinf(banned[:, 3]).all()  # a one-token word: everywhere in the completion
    assert not torch.isinf(banned[:, 4]).any()  # "0 4": the 0 before position 20 is the prompt's
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_ids=tuple(range(5000)))
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=((),))


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "sequential"])
def test_greedy_within_allowed_ids_equals_the_target_alone_within_them(cluster, tiny_models, pipeline):
    target = tiny_models["target"]
    with cluster.client() as client:
        for prompt in PROMPTS:
            plain = reference_greedy(target, prompt, 24)
            allowed = sorted({*plain[2:8], 11, 77, 100})  # not the first two it would say
            expected = reference_processed(target, prompt, 24, AllowOnly(allowed))
            assert expected != plain and set(expected) <= set(allowed)
            result = client.generate(prompt_ids=prompt, max_tokens=24, allowed_token_ids=allowed, pipeline=pipeline,
                                     num_draft_tokens=3)
            assert result.token_ids == expected
        sampled = client.generate(prompt_ids=PROMPTS[0], max_tokens=32, temperature=1.0, seed=3,
                                  allowed_token_ids=[4, 9, 120], pipeline=pipeline)
        assert set(sampled.token_ids) <= {4, 9, 120} and len(sampled.token_ids) == 32
        with pytest.raises(grpc.RpcError) as caught:
            client.generate(prompt_ids=PROMPTS[0], max_tokens=4, allowed_token_ids=[1, 500])
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "allowed_token_ids" in caught.value.details()


def test_a_draft_that_is_the_target_masks_alike_and_is_always_accepted_within_allowed_ids(same_cluster, tiny_models):
    target = tiny_models["target"]
    allowed = sorted(set(reference_greedy(target, PROMPTS[1], 16)[3:]) | {8})
    expected = reference_processed(target, PROMPTS[1], 32, AllowOnly(allowed))
    with same_cluster.client() as client:
        result = client.generate(prompt_ids=PROMPTS[1], max_tokens=32, allowed_token_ids=allowed, num_draft_tokens=4)
    assert result.token_ids == expected
    assert result.stats.drafted_tokens > 16 and result.stats.accepted_tokens == result.stats.drafted_tokens


def test_a_reduced_head_that_scores_none_of_the_allowed_ids_drafts_nothing_and_loses_nothing(tiny_models):
    """A draft of 24 scored tokens: allowed ids outside them end each block at
    once; the target alone decodes, and its tokens are the reference's."""
    from draft_service.server import DraftOptions

    cluster = Cluster(tiny_models["target"], tiny_models["target"], draft_options=DraftOptions(vocab_subset=24))
    try:
        with cluster.client() as client:
            for allowed in ([100, 101, 110, 120, 127], [1, 2, 100, 101, 110]):
                expected = reference_processed(tiny_models["target"], PROMPTS[0], 20, AllowOnly(allowed))
                for temperature in (0.0, 1.0):
                    result = client.generate(prompt_ids=PROMPTS[0], max_tokens=20, allowed_token_ids=allowed,
                                             temperature=temperature, seed=5, num_draft_tokens=3)
                    assert set(result.token_ids) <= set(allowed) and len(result.token_ids) == 20
                    if min(allowed) >= 24:  # the head scores ids below 24 here: none allowed, none drafted
                        assert result.stats.drafted_tokens == 0
                    if temperature == 0.0:
                        assert result.token_ids == expected
    finally:
        cluster.stop()


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "sequential"])
def test_greedy_with_bad_words_equals_the_target_alone_without_them(char_models, pipeline):
    """Text models: each word is tokenized (a character a token here), and
    the completion never holds it whole; greedy equals the reference that
    masks the same sequences over the completion."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(char_models["target"])
    prompt = "def fib(n):\n    "
    prompt_ids = tokenizer.encode(prompt)
    plain = reference_greedy(char_models["target"], prompt_ids, 40)
    text = tokenizer.decode(plain)

    def word_at(start: int, length: int) -> str:
        """The first printable piece of the completion at or after `start`
        that encodes to its own tokens (the random model writes control
        characters too)."""
        for i in range(start, len(plain) - length):
            word = text[i:i + length]
            if word.isprintable() and not word.isspace() and \
                    tokenizer.encode(word, add_special_tokens=False) == plain[i:i + length]:
                return word
        raise AssertionError(f"no printable piece of {length} in {text!r}")

    words = [word_at(2, 3), word_at(20, 2)]
    sequences = [tokenizer.encode(w, add_special_tokens=False) for w in words]
    expected = reference_processed(char_models["target"], prompt_ids, 40, BadWords(len(prompt_ids), sequences))
    assert expected != plain
    cluster = Cluster(char_models["target"], char_models["draft"], pipeline=pipeline)
    try:
        with cluster.client() as client:
            result = client.generate(prompt, max_tokens=40, bad_words=words, pipeline=pipeline)
            assert result.token_ids == expected and not any(w in result.text for w in words)
            with pytest.raises(grpc.RpcError) as caught:
                client.generate(prompt, max_tokens=4, bad_words=[" "])
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in caught.value.details()
    finally:
        cluster.stop()
