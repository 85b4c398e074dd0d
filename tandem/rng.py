"""Per-position random numbers.

Every random draw of a generation is a function of (seed, stream, absolute
position) only. Whatever the draft length, pipelining or the order in which
calls reach the services, the same seed gives the same draws at the same
positions, so a seeded sampled run is reproducible and identical with the
pipeline on or off.
"""
from __future__ import annotations

import numpy as np

DRAFT = 1  # the draft's sample of its proposed token
ACCEPT = 2  # the target's accept test of a draft token
TARGET = 3  # the target's own token: correction, bonus, or plain decode


def uniform(seed: int, stream: int, position: int) -> float:
    """A U[0, 1) draw, fixed by (seed, stream, position)."""
    return float(np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, stream, position]).random())


def uniforms(seed: int, stream: int, start: int, count: int) -> list[float]:
    return [uniform(seed, stream, start + i) for i in range(count)]
