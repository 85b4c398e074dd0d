"""Sampling parameters and the logits → probabilities processing.

Draft and target apply exactly the same processing (temperature, then top-k,
then top-p), so the acceptance rule compares the distributions that
target-only sampling would draw from (DESIGN §2, invariant 4).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


# Temperatures below this decode greedily, as in vLLM: dividing float32 logits
# by a much smaller one overflows, and the softmax of the result is NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below GREEDY_BELOW_TEMPERATURE) is greedy. top_p 1 and
    top_k 0 switch those filters off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] logits → [n, vocab] float32 probabilities (sampling only)."""
    assert logits.ndim == 2, logits.shape
    assert not params.greedy, "greedy decoding uses argmax, not probabilities"
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the most
        # likely token always stays.
        drop_sorted = (cumulative - sorted_scores.softmax(dim=-1)) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


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
