"""Log probabilities of committed tokens, as the target's verify reports them.

A token's log probability is the log-softmax of the target's raw logits at
its position, before temperature, top_p and top_k: the model's own
distribution, as vLLM reports it by default. It does not depend on the draft,
on the block a token was verified in, or on whether it was accepted or drawn
at a rejection, so it is what the target alone would report for that token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch

# The orchestrator and the clients import this module; they run without torch.
MAX_TOP_LOGPROBS = 20  # as OpenAI's API and vLLM's default max_logprobs


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float
    top_tokens: tuple[int, ...] = ()  # the most likely tokens at the position, most likely first
    top_logprobs: tuple[float, ...] = ()
    rank: int = 0  # 1 + how many tokens are likelier at the position (vLLM's rank); 0 = not reported


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int = 0) -> tuple[TokenLogprobs, ...]:
    """logits: [n, vocab], row i the target's scores at the position of
    tokens[i]; each token's log probability, its rank (1 for the likeliest,
    tied tokens sharing the best rank) and the `top` most likely tokens'."""
    import torch

    assert logits.ndim == 2 and logits.shape[0] == len(tokens), (logits.shape, len(tokens))
    if not tokens:
        return ()
    logp = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(list(tokens), dtype=torch.long, device=logp.device)[:, None]
    chosen = logp.gather(1, index)
    ranks = ((logp > chosen).sum(dim=-1) + 1).tolist()
    chosen = chosen.squeeze(1).tolist()
    if top <= 0:
        return tuple(TokenLogprobs(value, rank=rank) for value, rank in zip(chosen, ranks))
    values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
    return tuple(TokenLogprobs(value, tuple(row_ids), tuple(row_values), rank)
                 for value, row_ids, row_values, rank in zip(chosen, ids.tolist(), values.tolist(), ranks))
