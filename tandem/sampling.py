"""Sampling parameters. Their processing of logits into probabilities is in
tandem/distributions.py; this module needs no torch, so that the orchestrator
runs without it.
"""
from __future__ import annotations

from dataclasses import dataclass


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
