"""The acceptance rule: one pure function, no I/O, no model.

Glossary:
- draft tokens: the k tokens the draft proposes in a round.
- accepted tokens: the longest prefix of the draft tokens the target keeps.
- correction token: the target's token at the first rejected position.
- bonus token: the target's token after all k draft tokens were accepted.
Every round yields exactly one target token (a correction or a bonus), so it
commits between 1 and k+1 tokens.

Greedy: draft token i is accepted while it equals argmax of the target.
With alternatives (a token tree one level off the block): at the first
rejected position j, if an alternative verified there equals the target's
token, the round also commits the target's token after that alternative.
Every committed token is still the target's argmax after the tokens before it.
Sampling (Leviathan et al. 2023, Chen et al. 2023): accept draft token x with
probability min(1, target_probs(x) / draft_probs(x)); at the first rejection
draw from norm(max(0, target_probs - draft_dist)); if all pass, draw the bonus
from the target's next distribution. The committed tokens are then distributed
exactly as target-only sampling.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tandem.distributions import sample


@dataclass(frozen=True)
class Verdict:
    accepted: int  # draft tokens accepted, 0..k
    next_token: int  # correction (accepted < k) or bonus (accepted == k)
    taken: int | None = None  # index of the alternative that next_token is (greedy trees), else None
    more_tokens: tuple[int, ...] = ()  # committed after next_token: the target's token after the alternative taken


def verify_greedy(draft_tokens: Sequence[int], target_argmax: Sequence[int]) -> Verdict:
    """target_argmax: [k+1] argmax of the target at each draft position and after."""
    assert len(target_argmax) == len(draft_tokens) + 1
    accepted = 0
    for drafted, wanted in zip(draft_tokens, target_argmax):
        if drafted != wanted:
            break
        accepted += 1
    return Verdict(accepted, int(target_argmax[accepted]))


def verify_greedy_tree(draft_tokens: Sequence[int], target_argmax: Sequence[int],
                       alternatives: Sequence[tuple[int, int]], alternative_argmax: Sequence[int]) -> Verdict:
    """alternatives: (position j, token) pairs, at most one a position, each
    verified in place of draft token j; alternative_argmax: the target's argmax
    after each alternative."""
    assert len(alternative_argmax) == len(alternatives)
    verdict = verify_greedy(draft_tokens, target_argmax)
    for i, (position, token) in enumerate(alternatives):
        if position == verdict.accepted and token == verdict.next_token:
            return Verdict(verdict.accepted, verdict.next_token, i, (int(alternative_argmax[i]),))
    return verdict


def verify_sampled(
    draft_tokens: Sequence[int],
    draft_token_probs: Sequence[float],  # [k] draft probability of each draft token
    draft_dists: torch.Tensor | None,  # [k, vocab] full draft distributions, or None if k == 0
    target_probs: torch.Tensor,  # [k+1, vocab]
    accept_uniforms: Sequence[float],  # [k]
    target_uniforms: Sequence[float],  # [k+1]: for the correction or bonus draw
) -> Verdict:
    k = len(draft_tokens)
    assert target_probs.ndim == 2 and target_probs.shape[0] == k + 1, target_probs.shape
    assert len(draft_token_probs) == k and len(accept_uniforms) == k and len(target_uniforms) == k + 1
    for i, token in enumerate(draft_tokens):
        draft_p = float(draft_token_probs[i])
        target_p = float(target_probs[i, token])
        if draft_p > 0 and accept_uniforms[i] * draft_p < target_p:  # u < p/q without dividing
            continue
        assert draft_dists is not None and draft_dists.ndim == 2
        residual = (target_probs[i] - _aligned(draft_dists[i], target_probs.shape[1])).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: the residual is p itself
            residual = target_probs[i]
        return Verdict(i, sample(residual, target_uniforms[i]))
    return Verdict(k, sample(target_probs[k], target_uniforms[k]))


def _aligned(dist: torch.Tensor, vocab: int) -> torch.Tensor:
    """A draft distribution over the target's vocabulary length (heads may be padded)."""
    if dist.shape[0] == vocab:
        return dist
    if dist.shape[0] > vocab:
        return dist[:vocab]
    return torch.nn.functional.pad(dist, (0, vocab - dist.shape[0]))
