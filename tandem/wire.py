"""Conversions between tensors and the wire messages of tandem.v1."""
from __future__ import annotations

import numpy as np
import torch

from tandem.sampling import SamplingParams
from tandem.v1 import common_pb2


def encode_distribution(dist: torch.Tensor) -> common_pb2.Distribution:
    """[vocab] probabilities → Distribution, sparse when under a quarter is non-zero."""
    assert dist.ndim == 1, dist.shape
    dist = dist.detach().float().cpu()
    nonzero = torch.nonzero(dist, as_tuple=True)[0]
    if len(nonzero) * 4 < dist.shape[0]:
        return common_pb2.Distribution(
            ids=nonzero.tolist(), probs=dist[nonzero].tolist(), vocab_size=dist.shape[0]
        )
    return common_pb2.Distribution(
        dense_f32=dist.numpy().astype("<f4").tobytes(), vocab_size=dist.shape[0]
    )


def decode_distribution(msg: common_pb2.Distribution) -> torch.Tensor:
    """Distribution → [vocab_size] probabilities; raises ValueError (with words)
    on a malformed one: a dense length other than vocab_size, ids outside
    [0, vocab_size), ids and probs of different lengths, or probabilities that
    are negative or not finite."""
    if msg.vocab_size < 1:
        raise ValueError(f"a distribution needs vocab_size >= 1, got {msg.vocab_size}")
    if msg.dense_f32:
        if len(msg.dense_f32) != 4 * msg.vocab_size:
            raise ValueError(f"a dense distribution of vocab_size {msg.vocab_size} has {4 * msg.vocab_size} "
                             f"bytes, got {len(msg.dense_f32)}")
        dist = torch.from_numpy(np.frombuffer(msg.dense_f32, dtype="<f4").copy())
    else:
        if len(msg.ids) != len(msg.probs):
            raise ValueError(f"a sparse distribution has {len(msg.ids)} ids and {len(msg.probs)} probs")
        dist = torch.zeros(msg.vocab_size, dtype=torch.float32)
        if msg.ids:
            ids = torch.tensor(list(msg.ids), dtype=torch.long)
            if int(ids.min()) < 0 or int(ids.max()) >= msg.vocab_size:
                raise ValueError(f"a sparse distribution has ids outside [0, {msg.vocab_size})")
            dist[ids] = torch.tensor(list(msg.probs), dtype=torch.float32)
    if not bool(torch.isfinite(dist).all()) or bool((dist < 0).any()):
        raise ValueError("a distribution has negative or non-finite probabilities")
    return dist


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError on out-of-range values."""
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p if msg.top_p != 0 else 1.0,
        top_k=msg.top_k,
        seed=msg.seed,
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=params.seed
    )
