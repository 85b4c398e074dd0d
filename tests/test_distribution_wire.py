"""Draft distributions on the wire (common.proto Distribution): what the
target decodes is exactly what the draft encoded, in the smaller of the two
forms, and a malformed one is refused with words."""
import numpy as np
import pytest
import torch

from tandem.distributions import (SubsetDist, decode_distribution, decode_distributions, encode_distribution,
                                  encode_distributions, logits_to_probs)
from tandem.sampling import SamplingParams
from tandem.v1 import common_pb2

VOCAB = 151_936  # the default pair's


def _reduced_head(subset: int, seed: int = 0) -> torch.Tensor:
    """A draft distribution that is zero outside a subset of the vocabulary,
    as a reduced head's (--vocab-subset) is."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.full((VOCAB,), float("-inf"))
    subset_ids = torch.randperm(VOCAB, generator=generator)[:subset]
    logits[subset_ids] = torch.randn(subset, generator=generator) * 3
    return torch.softmax(logits, dim=0)


@pytest.mark.parametrize("make, form", [
    (lambda: _reduced_head(32_768), "sparse"),
    (lambda: torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)) * 3, dim=0), "dense"),
    (lambda: logits_to_probs(torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2)),
                             SamplingParams(temperature=0.7, top_p=0.9))[0], "sparse"),  # after top-p
    (lambda: torch.nn.functional.one_hot(torch.tensor(7), VOCAB).float(), "sparse"),
])
def test_a_distribution_crosses_the_wire_bit_for_bit_in_the_smaller_form(make, form):
    dist = make()
    msg = common_pb2.Distribution.FromString(encode_distribution(dist).SerializeToString())
    assert ("sparse" if msg.sparse_ids_i32 else "dense") == form
    assert bool(msg.dense_f32) != bool(msg.sparse_ids_i32)
    decoded = decode_distribution(msg)
    assert decoded.dtype == torch.float32 and decoded.shape == (VOCAB,)
    assert torch.equal(decoded, dist.float())  # exact: the residual draw depends on every entry
    nonzero = int((dist > 0).sum())
    assert msg.ByteSize() <= min(8 * nonzero, 4 * VOCAB) + 32  # never more than the smaller form, plus framing


def test_a_decoded_distribution_is_its_own_writable_tensor():
    msg = encode_distribution(torch.softmax(torch.randn(64), dim=0))
    decoded = decode_distribution(msg)
    decoded[0] = 5.0  # the message's bytes are read-only; the tensor is not a view of them
    assert decode_distribution(msg)[0] != 5.0


def _raw(**fields) -> common_pb2.Distribution:
    return common_pb2.Distribution(**fields)


def _ids(*ids) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def _probs(*probs) -> bytes:
    return np.asarray(probs, dtype="<f4").tobytes()


@pytest.mark.parametrize("msg, words", [
    (_raw(vocab_size=8), "exactly one form"),
    (_raw(dense_f32=_probs(*[0.125] * 8), sparse_ids_i32=_ids(1), sparse_probs_f32=_probs(1.0), vocab_size=8),
     "exactly one form"),
    (_raw(sparse_ids_i32=_ids(1), vocab_size=8), "as many of both"),
    (_raw(sparse_ids_i32=_ids(1, 2), sparse_probs_f32=_probs(1.0), vocab_size=8), "as many of both"),
    (_raw(sparse_ids_i32=b"\1\0\0", sparse_probs_f32=b"\0\0\x80", vocab_size=8), "4 bytes each"),
    (_raw(sparse_ids_i32=_ids(8), sparse_probs_f32=_probs(1.0), vocab_size=8), "outside [0, 8)"),
    (_raw(sparse_ids_i32=_ids(-1), sparse_probs_f32=_probs(1.0), vocab_size=8), "outside [0, 8)"),
    (_raw(sparse_ids_i32=_ids(1, 9, 2), sparse_probs_f32=_probs(0.5, 0.25, 0.25), vocab_size=8), "ascend"),
    (_raw(sparse_ids_i32=_ids(3, 1), sparse_probs_f32=_probs(0.5, 0.5), vocab_size=8), "ascend"),
    (_raw(sparse_ids_i32=_ids(2, 2), sparse_probs_f32=_probs(0.5, 0.5), vocab_size=8), "ascend"),
    (_raw(sparse_ids_i32=_ids(1), sparse_probs_f32=_probs(float("inf")), vocab_size=8), "non-finite"),
    (_raw(dense_f32=_probs(*[0.125] * 7), vocab_size=8), "has 32 bytes, got 28"),
    (_raw(dense_f32=_probs(-0.5, *[0.25] * 6, 0.0), vocab_size=8), "negative"),
    (_raw(sparse_ids_i32=_ids(1), sparse_probs_f32=_probs(1.0)), "vocab_size >= 1"),
])
def test_a_malformed_distribution_is_refused_with_words(msg, words):
    for decode in (decode_distribution, lambda msg: decode_distributions([msg])):  # alone, and as a block's row
        with pytest.raises(ValueError) as info:
            decode(msg)
        assert words in str(info.value)


def _subset_dist(ids: list[int], seed: int) -> SubsetDist:
    probs = torch.softmax(torch.randn(len(ids), generator=torch.Generator().manual_seed(seed)) * 3, dim=0)
    return SubsetDist(np.asarray(ids, dtype="<i4").tobytes(), probs, VOCAB)


def _spread(dist: SubsetDist) -> torch.Tensor:
    row = torch.zeros(VOCAB)
    row[torch.from_numpy(np.frombuffer(dist.ids_i32, dtype="<i4").astype(np.int64))] = dist.probs
    return row


def test_a_block_over_one_subset_sends_its_ids_once_and_decodes_bit_for_bit():
    """A reduced head's rows all have the same ids: a block sends them once,
    beside the rows (wire version 3), and what the target decodes is each row
    spread over the vocabulary, exactly."""
    ids = sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:32_768].tolist())
    block = [_subset_dist(ids, seed) for seed in range(4)]
    messages, shared = encode_distributions(block)
    assert shared == block[0].ids_i32 and all(m.shared_ids and not m.sparse_ids_i32 for m in messages)
    wire = [common_pb2.Distribution.FromString(m.SerializeToString()) for m in messages]
    assert sum(m.ByteSize() for m in wire) + len(shared) < 5 * 4 * len(ids) + 64  # the ids once, not four times
    decoded = decode_distributions(wire, shared)
    assert decoded.shape == (4, VOCAB) and torch.equal(decoded, torch.stack([_spread(d) for d in block]))
    decoded[0, 0] = 5.0  # its own tensor, not a view of the message's bytes
    assert decode_distributions(wire, shared)[0, 0] != 5.0


def test_a_block_of_mixed_forms_shares_only_the_first_subset_s_ids():
    """Rows over other ids, or whole rows (a call that adjusts its logits),
    keep their own form in the same block."""
    first, other = list(range(0, 600, 3)), list(range(1, 600, 5))
    dense = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(9)), dim=0)
    block = [_subset_dist(first, 1), _subset_dist(other, 2), dense, _subset_dist(first, 4)]
    messages, shared = encode_distributions(block)
    assert shared == block[0].ids_i32
    assert [m.shared_ids for m in messages] == [True, False, False, True]
    assert messages[1].sparse_ids_i32 == block[1].ids_i32 and len(messages[2].dense_f32) == 4 * VOCAB
    expected = torch.stack([_spread(block[0]), _spread(block[1]), dense, _spread(block[3])])
    assert torch.equal(decode_distributions(messages, shared), expected)
    assert encode_distributions([dense]) == ([encode_distribution(dense)], b"")  # nothing to share


def test_a_subset_row_with_few_non_zero_entries_goes_over_those_alone():
    """After top-p a row of the 32k head has non-zero entries for a few of its
    tokens: it goes in its own sparse form over them (8 bytes an entry), not
    over the whole subset (4 bytes an entry of the subset, and the ids once);
    a row over the whole subset in the same block still shares the ids."""
    ids = sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[:32_768].tolist())
    wide = _subset_dist(ids, 1)
    logits = torch.randn(1, len(ids), generator=torch.Generator().manual_seed(2)) * 3
    narrow = SubsetDist(wide.ids_i32, logits_to_probs(logits, SamplingParams(temperature=0.7, top_p=0.9))[0], VOCAB)
    nonzero = int((narrow.probs > 0).sum())
    assert 0 < nonzero < len(ids) // 2
    messages, shared = encode_distributions([narrow, wide, narrow])
    assert [m.shared_ids for m in messages] == [False, True, False] and shared == wide.ids_i32
    assert len(messages[0].sparse_ids_i32) == len(messages[0].sparse_probs_f32) == 4 * nonzero
    assert encode_distribution(narrow) == messages[0]  # alone, the same form
    expected = torch.stack([_spread(narrow), _spread(wide), _spread(narrow)])
    assert torch.equal(decode_distributions(messages, shared), expected)
    assert encode_distributions([narrow])[1] == b""  # no row over the whole subset: no ids to share


def _shared(*probs, vocab_size=8) -> common_pb2.Distribution:
    return _raw(shared_ids=True, sparse_probs_f32=_probs(*probs), vocab_size=vocab_size)


@pytest.mark.parametrize("msgs, shared, words", [
    ([_shared(0.5, 0.5)], b"", "no ids are shared"),
    ([_shared(0.5, 0.5)], _ids(1), "4 bytes each, as many as the ids"),
    ([_shared(0.5, 0.5)], _ids(1, 2)[:7], "4 bytes each"),
    ([_shared(0.5, 0.5)], _ids(2, 1), "ascend"),
    ([_shared(0.5, 0.5)], _ids(1, 8), "outside [0, 8)"),
    ([_shared(0.5, float("nan"))], _ids(1, 2), "non-finite"),
    ([_raw(shared_ids=True, sparse_ids_i32=_ids(1, 2), sparse_probs_f32=_probs(0.5, 0.5), vocab_size=8)], _ids(1, 2),
     "exactly one form"),
    ([_shared(0.5, 0.5), _shared(0.5, 0.5, vocab_size=9)], _ids(1, 2), "differ in vocab_size"),
    ([_shared(0.5, 0.5, vocab_size=0)], _ids(1, 2), "vocab_size >= 1"),
    ([_shared(1.0), _raw(vocab_size=8)], _ids(1), "exactly one form"),  # a malformed row beside a good one
    ([], b"", "no distributions"),
])
def test_a_malformed_block_is_refused_with_words(msgs, shared, words):
    with pytest.raises(ValueError) as info:
        decode_distributions(msgs, shared)
    assert words in str(info.value)


def test_a_row_over_shared_ids_is_not_decoded_without_them():
    with pytest.raises(ValueError, match="decode_distributions"):
        decode_distribution(_shared(0.5, 0.5))


def test_the_sampling_probe_runs_on_the_tiny_pair_and_counts_the_bytes_only_sampling_sends(char_models, tmp_path):
    """bench.sampling_probe on the tiny pair: real processes; greedy requests
    forward no distribution, sampled ones every drafted token's."""
    import json

    from bench.sampling_probe import main

    out = tmp_path / "sampling_probe.json"
    threads = torch.get_num_threads()
    assert main(["--target", char_models["target"], "--draft", char_models["draft"], "--draft-args", "",
                 "--dtype", "float32", "--prompts", "code-1,prose-1", "--new-tokens", "12", "--reps", "1",
                 "--threads", str(threads + 1), "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads  # the target alone ran in this process and left it as it was
    result = json.loads(out.read_text())
    greedy, sampled = result["modes"]["greedy"], result["modes"]["sampled"]
    assert greedy["requests"] == sampled["requests"] == 2
    assert greedy["distribution_bytes_per_round"] == 0 < sampled["distribution_bytes_per_round"]
    assert all(run["tokens"] == 12 for runs in result["runs"].values() for run in runs)
    assert greedy["tok_s"] > 0 and sampled["tok_s"] > 0 and result["sampling"]["temperature"] == 0.8
    assert all(0 <= mode["predraft_hit_rate"] <= 1 and mode["mean_k"] > 0 for mode in (greedy, sampled))
    for mode in ("greedy", "sampled"):  # the target alone, every prompt to --new-tokens
        alone = result["target_alone"][mode]
        assert alone["tokens"] == 2 * 12 and alone["tok_s"] > 0
        assert result["speedup_vs_target_alone"][mode] == result["modes"][mode]["tok_s"] / alone["tok_s"]
