"""Probability distributions over the vocabulary: made from logits, drawn from,
and sent on the wire (tandem.v1's Distribution).

Draft and target apply exactly the same processing (temperature, then top-k,
then top-p), so the acceptance rule compares the distributions that
target-only sampling would draw from (DESIGN §2, invariant 4).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from tandem.grammar import apply_masks
from tandem.sampling import SamplingParams
from tandem.v1 import common_pb2


def adjust_logits(logits: torch.Tensor, params: SamplingParams, first_position: int,
                  tokens: Sequence[int] = ()) -> torch.Tensor:
    """[n, vocab] logits whose row i scores absolute position first_position + i,
    with the request's logit bias added, its penalties taken off (counted over
    tokens[penalty_start: first_position + i], `tokens` being the sequence up
    to the last row's position at least) and its suppressed tokens at -inf where
    the position is below suppress_before; the logits themselves when the
    request adjusts nothing. In that order: the repetition penalty (over the
    whole sequence before each position), the presence and frequency penalties,
    the bias, the suppression, the grammar's mask. Greedy decoding takes the argmax of these, sampling
    their processed probabilities (logits_to_probs). Ids past the vocabulary
    are ignored (a draft's may be narrower than the target's)."""
    assert logits.ndim == 2, logits.shape
    if not params.adjusts:
        return logits
    vocab = logits.shape[-1]
    out = logits.to(torch.float32, copy=True)
    if params.repetition_penalty != 1.0:
        _repeat(out, params.repetition_penalty, first_position, tokens)
    if params.penalizes:
        ids, penalties = _penalties(params, first_position, out.shape[0], tokens, vocab)
        if len(ids):
            out[:, ids.to(out.device)] -= penalties.to(out.device)
    bias = [(token, value) for token, value in params.logit_bias if token < vocab]
    if bias:
        ids = torch.tensor([token for token, _ in bias], device=out.device)
        out[:, ids] += torch.tensor([value for _, value in bias], device=out.device)
    rows = min(max(params.suppress_before - first_position, 0), out.shape[0])
    suppressed = [token for token in params.suppress_ids if token < vocab]
    if rows and suppressed:
        out[:rows, torch.tensor(suppressed, device=out.device)] = float("-inf")
    if params.allowed_ids:
        allowed = torch.tensor([token for token in params.allowed_ids if token < vocab], dtype=torch.long,
                               device=out.device)
        kept = out[:, allowed]
        out.fill_(float("-inf"))
        out[:, allowed] = kept
    if params.bad_words:
        _ban_words(out, params, first_position, tokens)
    if params.grammar:
        if params.masks is None:
            raise RuntimeError("a grammar's masks need the service's GrammarMasks (tandem.wire.sampling_from_proto)")
        begins = params.masks.begins(params.grammar_after, params.grammar_start, tokens,
                                     first_position + out.shape[0] - 1)
        free = out.shape[0] if begins is None else min(max(begins - first_position, 0), out.shape[0])
        if free < out.shape[0]:  # the rows before the grammar begins are free (grammar_after)
            apply_masks(out[free:], params.masks.mask_rows(params.grammar, params.grammar_end_ids, begins,
                                                           first_position + free, out.shape[0] - free, tokens))
    return out


def _ban_words(out: torch.Tensor, params: SamplingParams, first_position: int, tokens: Sequence[int]) -> None:
    """bad_words, in place: in row i, the last token of each word whose other
    tokens end the sequence before position first_position + i, all of them
    within the completion (from penalty_start on)."""
    rows, vocab = out.shape
    assert len(tokens) >= first_position + rows - 1, "the tokens before the last row are needed"
    for i in range(rows):
        position = first_position + i
        for word in params.bad_words:
            before = len(word) - 1
            if word[-1] < vocab and position - before >= params.penalty_start and \
                    all(tokens[position - before + j] == word[j] for j in range(before)):
                out[i, word[-1]] = float("-inf")


def _repeat(out: torch.Tensor, penalty: float, first_position: int, tokens: Sequence[int]) -> None:
    """The repetition penalty, in place: in row i, over the tokens of the
    sequence before position first_position + i."""
    rows, vocab = out.shape
    assert len(tokens) >= first_position + rows - 1, "the tokens before the last row are needed"
    base = {t for t in tokens[:first_position] if 0 <= t < vocab}
    ids = torch.tensor(sorted(base), dtype=torch.long, device=out.device)
    added: list[int] = []  # the block's tokens before the row that the sequence did not hold
    for i in range(rows):
        if i and 0 <= (t := tokens[first_position + i - 1]) < vocab and t not in base and t not in added:
            added.append(t)
        row_ids = torch.cat([ids, torch.tensor(added, dtype=torch.long, device=out.device)]) if added else ids
        values = out[i, row_ids]
        out[i, row_ids] = torch.where(values > 0, values / penalty, values * penalty)


def _penalties(params: SamplingParams, first_position: int, rows: int, tokens: Sequence[int],
               vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the presence and frequency penalties take off each row, sparsely:
    the token ids that came in the completion before the last row, and a [rows,
    len(ids)] tensor of what each row loses at each."""
    assert len(tokens) >= first_position + rows - 1, "the tokens before the last row are needed"
    before = tokens[params.penalty_start:first_position]
    block = [tokens[first_position + i - 1] if first_position + i - 1 >= params.penalty_start else -1
             for i in range(1, rows)]  # the token before row i, for rows past the first
    seen = Counter(t for t in before if 0 <= t < vocab)
    ids = sorted(seen.keys() | {t for t in block if 0 <= t < vocab})
    column = {t: j for j, t in enumerate(ids)}
    table = [[seen[t] for t in ids]]  # row 0's counts; each later row adds the block token before it
    for t in block:
        row = list(table[-1])
        if t in column:
            row[column[t]] += 1
        table.append(row)
    counts = torch.tensor(table, dtype=torch.float32).reshape(rows, len(ids))
    return torch.tensor(ids, dtype=torch.long), params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams, first_position: int = 0,
                    tokens: Sequence[int] = ()) -> torch.Tensor:
    """[n, vocab] logits, row i at absolute position first_position + i (and
    `tokens`, the sequence, for penalties; see adjust_logits) → [n, vocab]
    float32 probabilities (sampling only)."""
    assert logits.ndim == 2, logits.shape
    assert not params.greedy, "greedy decoding uses argmax, not probabilities"
    scores = adjust_logits(logits, params, first_position, tokens).float() / params.temperature
    if params.min_p:
        probs = scores.softmax(dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        scores = scores.masked_fill(_beyond_top_p(scores, params.top_p), float("-inf"))
    return scores.softmax(dim=-1)


# How many of a row's most likely tokens top-p looks among first: a partial
# sort of them costs 0.6 ms for a row of 151,936 on a core of a Zen 5 VM, a
# sort of the whole row 11.7.
TOP_P_CANDIDATES = 1024


def _beyond_top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """[n, vocab] scores → the mask of the tokens that top-p drops: each
    token whose more likely tokens already have a mass of top_p or more (the
    most likely token always stays). Found among a row's TOP_P_CANDIDATES most
    likely tokens where their mass reaches top_p, by sorting the whole row
    only where it does not (a flat distribution)."""
    assert scores.ndim == 2, scores.shape
    probs = scores.softmax(dim=-1)
    drop = torch.ones_like(probs, dtype=torch.bool)
    top_probs, order = probs.topk(min(TOP_P_CANDIDATES, probs.shape[-1]), dim=-1)  # descending
    drop_sorted = (top_probs.cumsum(dim=-1) - top_probs) >= top_p
    drop.scatter_(-1, order, drop_sorted)
    for row in torch.nonzero(~drop_sorted[:, -1]).flatten().tolist():  # the cut lies beyond the candidates
        row_probs, row_order = probs[row].sort(descending=True)
        drop[row].scatter_(0, row_order, (row_probs.cumsum(dim=0) - row_probs) >= top_p)
    return drop


def sample(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from [vocab] probabilities with the uniform u in [0, 1).

    The first index whose cumulative mass exceeds u·total: a token with zero
    probability adds no width, so it is never drawn."""
    assert probs.ndim == 1, probs.shape
    cdf = probs.double().cumsum(0)
    point = torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device)
    index = int(torch.searchsorted(cdf, point, right=True).item())
    if index >= probs.shape[0]:  # rounding at the top end
        index = int(torch.nonzero(probs)[-1].item())
    return index


@dataclass(frozen=True, eq=False)
class SubsetDist:
    """A distribution that is zero outside a fixed set of ids: `probs` over
    the ids that `ids_i32` packs (ascending, little-endian int32), in a
    vocabulary of `vocab_size`. What a reduced draft head draws from
    (draft_service.cheap.ReducedHead), kept in the subset's space, not spread
    over the whole vocabulary for its non-zero entries to be found again: with
    the default pair's 32k head, a sampled round's time in the services'
    handlers beyond their compute fell from 2.79-3.66 ms to 1.64-1.81 ms p50
    (three pairs of runs on a Zen 5 VM, bench/RESULTS.md)."""

    ids_i32: bytes
    probs: torch.Tensor  # [len(ids)] float32
    vocab_size: int


def encode_distribution(dist: torch.Tensor | SubsetDist) -> common_pb2.Distribution:
    """[vocab] probabilities → Distribution: sparse (ids and probabilities as
    packed bytes) when under half the entries are non-zero, else dense. A
    SubsetDist goes sparse over its non-zero entries where they are under
    half of its subset, else over its ids, zeros included."""
    if isinstance(dist, SubsetDist):
        return _nonzero_form(dist) or _over_subset(dist, dist.ids_i32)
    assert dist.ndim == 1, dist.shape
    dist = dist.detach().float().cpu()
    vocab = dist.shape[0]
    nonzero = torch.nonzero(dist, as_tuple=True)[0]
    if 2 * len(nonzero) < vocab:
        return common_pb2.Distribution(
            sparse_ids_i32=nonzero.numpy().astype("<i4").tobytes(),
            sparse_probs_f32=dist[nonzero].numpy().astype("<f4").tobytes(), vocab_size=vocab,
        )
    return common_pb2.Distribution(dense_f32=dist.numpy().astype("<f4").tobytes(), vocab_size=vocab)


def _packed(probs: torch.Tensor) -> bytes:
    return probs.detach().float().cpu().numpy().astype("<f4").tobytes()


def _nonzero_form(dist: SubsetDist) -> common_pb2.Distribution | None:
    """A SubsetDist whose non-zero entries are under half of its subset's
    (after top-k, top-p or min_p) as its own sparse form over them, the
    smaller form; None for one to send over the whole subset."""
    count = int(torch.count_nonzero(dist.probs))  # a count is a seventh of the ids' cost on a 32k row
    if not count or 2 * count >= dist.probs.shape[0]:
        return None
    nonzero = torch.nonzero(dist.probs, as_tuple=True)[0].cpu()
    ids = np.frombuffer(dist.ids_i32, dtype="<i4")[nonzero.numpy()]  # ascending, as the subset's are
    return common_pb2.Distribution(sparse_ids_i32=ids.tobytes(), sparse_probs_f32=_packed(dist.probs[nonzero]),
                                   vocab_size=dist.vocab_size)


def encode_distributions(dists: Sequence[torch.Tensor | SubsetDist]) -> tuple[list[common_pb2.Distribution], bytes]:
    """A block's distributions → their Distributions and the ids that those
    with shared_ids are over (ProposeReply.distribution_ids_i32; b"" when
    none): the ids of the first SubsetDist sent over its whole subset go
    once, and every such SubsetDist over the same ids sends its probabilities
    alone. With the default pair's 32k head a sampled block of 4 rows is then
    0.66 MB on the wire instead of 1.05 MB. A SubsetDist with non-zero
    entries for under half of its subset (after top-k, top-p or min_p) goes
    in its own sparse form over them, the smaller."""
    msgs, shared = [], b""
    for dist in dists:
        if not isinstance(dist, SubsetDist):
            msgs.append(encode_distribution(dist))
        elif (own := _nonzero_form(dist)) is not None:
            msgs.append(own)
        else:
            shared = shared or dist.ids_i32
            msgs.append(_over_subset(dist, b"" if dist.ids_i32 == shared else dist.ids_i32))
    return msgs, shared


def _over_subset(dist: SubsetDist, ids_i32: bytes) -> common_pb2.Distribution:
    """A SubsetDist over its whole subset, zeros included: with these ids, or
    with shared_ids where ids_i32 is empty."""
    return common_pb2.Distribution(sparse_ids_i32=ids_i32, shared_ids=not ids_i32,
                                   sparse_probs_f32=_packed(dist.probs), vocab_size=dist.vocab_size)


def decode_distributions(msgs: Sequence[common_pb2.Distribution], shared_ids: bytes = b"") -> torch.Tensor:
    """A block's Distributions (and the ids that those with shared_ids are
    over) → [len(msgs), vocab_size] probabilities, one row each; raises
    ValueError (with words) on a malformed one (see decode_distribution), on
    rows of different vocab_size, and on a row with shared_ids when no ids
    are shared. The shared ids are checked once, and their rows are spread
    over the vocabulary in one step."""
    if not msgs:
        raise ValueError("no distributions to decode")
    vocab = msgs[0].vocab_size
    if vocab < 1:
        raise ValueError(f"a distribution needs vocab_size >= 1, got {vocab}")
    if any(msg.vocab_size != vocab for msg in msgs):
        raise ValueError("the distributions differ in vocab_size")
    ids = None
    if any(msg.shared_ids for msg in msgs):
        if not shared_ids:
            raise ValueError("a distribution has shared_ids but no ids are shared (distribution_ids_i32 is empty)")
        ids = _checked_ids(shared_ids, vocab)
    out = torch.zeros(len(msgs), vocab, dtype=torch.float32)
    rows = [i for i, msg in enumerate(msgs) if msg.shared_ids]
    if rows:
        values = torch.from_numpy(np.stack([_sparse_values(msgs[i], ids) for i in rows]))  # a copy: writable
        columns = torch.from_numpy(ids.astype(np.int64))
        if len(rows) == len(msgs):
            out[:, columns] = values
        else:
            out[torch.tensor(rows)[:, None], columns[None, :]] = values
    for i, msg in enumerate(msgs):
        if not msg.shared_ids:
            out[i] = decode_distribution(msg)
    return out


def _checked_ids(ids_i32: bytes, vocab: int) -> np.ndarray:
    if len(ids_i32) % 4:
        raise ValueError(f"a sparse distribution has {len(ids_i32)} bytes of ids: 4 bytes each")
    ids = np.frombuffer(ids_i32, dtype="<i4")
    if len(ids) and (int(ids[0]) < 0 or int(ids[-1]) >= vocab):
        raise ValueError(f"a sparse distribution has ids outside [0, {vocab})")
    if (np.diff(ids) <= 0).any():  # so each id comes once
        raise ValueError("a sparse distribution's ids must ascend")
    return ids


def _sparse_values(msg: common_pb2.Distribution, ids: np.ndarray) -> np.ndarray:
    """The probabilities of a row with shared_ids, checked against the ids."""
    if msg.dense_f32 or msg.sparse_ids_i32:
        raise ValueError("a distribution needs exactly one form: one with shared_ids has sparse_probs_f32 alone")
    if len(msg.sparse_probs_f32) != 4 * len(ids):
        raise ValueError(f"a sparse distribution over {len(ids)} shared ids has {len(msg.sparse_probs_f32)} bytes "
                         f"of probabilities: 4 bytes each, as many as the ids")
    return _checked_values(np.frombuffer(msg.sparse_probs_f32, dtype="<f4"))


def _checked_values(values: np.ndarray) -> np.ndarray:
    if not np.isfinite(values).all() or (values < 0).any():
        raise ValueError("a distribution has negative or non-finite probabilities")
    return values


def decode_distribution(msg: common_pb2.Distribution) -> torch.Tensor:
    """Distribution → [vocab_size] probabilities; raises ValueError (with words)
    on a malformed one: neither form or both, a dense length other than
    vocab_size, sparse ids and probabilities of different counts, ids that do
    not ascend or lie outside [0, vocab_size), or probabilities that are
    negative or not finite. One with shared_ids needs its block's ids:
    decode_distributions."""
    if msg.vocab_size < 1:
        raise ValueError(f"a distribution needs vocab_size >= 1, got {msg.vocab_size}")
    if msg.shared_ids:
        raise ValueError("a distribution with shared_ids is decoded with its block's ids (decode_distributions)")
    sparse = bool(msg.sparse_ids_i32 or msg.sparse_probs_f32)
    if bool(msg.dense_f32) == sparse:
        raise ValueError("a distribution needs exactly one form: dense_f32, or sparse_ids_i32 with sparse_probs_f32")
    if msg.dense_f32:
        if len(msg.dense_f32) != 4 * msg.vocab_size:
            raise ValueError(f"a dense distribution of vocab_size {msg.vocab_size} has {4 * msg.vocab_size} "
                             f"bytes, got {len(msg.dense_f32)}")
        values = _checked_values(np.frombuffer(msg.dense_f32, dtype="<f4"))
        return torch.from_numpy(values.astype(np.float32))  # a copy: the message's bytes are read-only
    if len(msg.sparse_ids_i32) % 4 or len(msg.sparse_ids_i32) != len(msg.sparse_probs_f32):
        raise ValueError(f"a sparse distribution has {len(msg.sparse_ids_i32)} bytes of ids and "
                         f"{len(msg.sparse_probs_f32)} of probabilities: 4 bytes each, as many of both")
    ids = _checked_ids(msg.sparse_ids_i32, msg.vocab_size)
    values = _checked_values(np.frombuffer(msg.sparse_probs_f32, dtype="<f4"))
    dist = torch.zeros(msg.vocab_size, dtype=torch.float32)
    dist[torch.from_numpy(ids.astype(np.int64))] = torch.from_numpy(values.astype(np.float32))
    return dist
