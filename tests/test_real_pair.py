"""The real default pair (Qwen2.5-Coder 1.5B target, 0.5B draft), fp32, over
real gRPC: greedy Tandem output is token-identical to the target alone."""
import gc

import pytest

from tests.conftest import Cluster, reference_greedy

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
    finally:
        cluster.stop()
