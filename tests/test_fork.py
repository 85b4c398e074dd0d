"""A model service's ForkSession: a copy of a prefix of one session's cache,
as its store makes it for every kind of cache (Hugging Face's DynamicCache on
the target, the lean StaticKV on the draft, with or without the runner's
static buffers, and the n-gram drafter's history alone)."""
import pytest
import torch

from tandem import fingerprint
from tandem.lean import MAX_STATIC_ROWS, LeanRunner
from tandem.modeling import ModelConfig, ModelRunner, load
from tandem.session_cache import NullKV, SessionCacheStore

PROMPT = [(7 * i) % 120 + 1 for i in range(30)]
AFTER = [5, 9, 17, 33]


def _runners(model_dir):
    loaded = load(ModelConfig(model_dir, dtype="float32"))
    return {
        "dynamic": ModelRunner(loaded, "cpu"),
        "static": LeanRunner(loaded, "cpu", fused=False),
        "static-buffers": LeanRunner(loaded, "cpu", fused=False, static_rows=MAX_STATIC_ROWS),
    }


def _fed(store, runner, session_id, tokens):
    cache, _ = store.checkout(session_id, 0, 0)
    runner.forward(cache.kv, tokens, logits_to_keep=1)
    cache.append(tokens)
    cache.mark_fed()
    return cache


@pytest.mark.parametrize("kind", ["dynamic", "static", "static-buffers"])
def test_a_fork_continues_as_a_fresh_prefill_of_its_prefix_and_leaves_the_source_alone(tiny_models, kind):
    runner = _runners(tiny_models["target"])[kind]
    store = SessionCacheStore(runner.new_cache)
    source = _fed(store, runner, "source", PROMPT)
    length = 20
    assert store.fork("source", "copy", length, fingerprint.of(PROMPT[:length]))
    copy, cropped = store.checkout("copy", length, fingerprint.of(PROMPT[:length]))
    assert cropped == 0 and copy.tokens == PROMPT[:length] and copy.kv_len == length
    got = runner.forward(copy.kv, AFTER, logits_to_keep=len(AFTER))
    fresh = runner.new_cache()
    expected = runner.forward(fresh, PROMPT[:length] + AFTER, logits_to_keep=len(AFTER))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # The source is as it was: its own continuation equals a fresh prefill of it.
    source, _ = store.checkout("source", len(PROMPT), fingerprint.of(PROMPT))
    got = runner.forward(source.kv, AFTER, logits_to_keep=len(AFTER))
    expected = runner.forward(runner.new_cache(), PROMPT + AFTER, logits_to_keep=len(AFTER))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert store.total_bytes() > 0 and len(store) == 2


def test_a_fork_of_a_prefix_the_source_does_not_hold_makes_nothing(tiny_models):
    runner = _runners(tiny_models["target"])["dynamic"]
    store = SessionCacheStore(runner.new_cache)
    _fed(store, runner, "source", PROMPT)
    _fed(store, runner, "copy", AFTER)  # what the new session held before is replaced either way
    assert not store.fork("source", "copy", 20, fingerprint.of(AFTER))  # other tokens
    assert not store.fork("source", "copy", len(PROMPT) + 1, fingerprint.of(PROMPT + [1]))  # more than it holds
    assert not store.fork("gone", "copy", 5, fingerprint.of(PROMPT[:5]))
    assert "copy" not in store and "source" in store


def test_a_history_only_cache_forks_its_history():
    """The n-gram drafter keeps no keys or values, only the tokens."""
    store = SessionCacheStore(NullKV)
    cache, _ = store.checkout("source", 0, 0)
    cache.append(PROMPT)
    assert store.fork("source", "copy", 12, fingerprint.of(PROMPT[:12]))
    copy = store.peek("copy")
    assert copy.tokens == PROMPT[:12] and isinstance(copy.kv, NullKV)
    copy.append([1, 2])
    assert store.peek("source").tokens == PROMPT
