"""Making the draft cheaper without losing a token: the target verifies every
draft token, so any change to the draft costs acceptance, never correctness.

- ReducedHead (FR-Spec, 2025): score only the N most frequent tokens instead of
  the whole vocabulary; the draft's distribution is zero outside the subset.
- int8 dynamic quantization of the draft's linear layers (fbgemm), several times
  faster than bf16/fp32 matrix-vector products on CPUs without native bf16.
  Weights get one scale per output channel. Activations get one scale per
  forward, so the probabilities of a token depend on which tokens shared its
  forward: the pipeline, which splits the draft's input differently, changes a
  seeded sampled run (never a greedy one, and never the output distribution,
  which the target's rejection rule fixes).
  One scale per weight tensor (up to 2026-11) cost the default pair's draft
  agreement on prose; one per output channel recovers nearly all of it with
  the same kernel. Agreement of the draft's greedy token with the float32
  target's along the target's greedy output, decoding as the draft service
  does (prompt in one forward, then one token per forward), 4 prompts × 128
  tokens (code-1, code-2, prose-1, prose-2), full head: float32
  0.945/0.969/0.656/0.625 (mean 0.799); int8 per tensor 0.938/0.977/0.555/0.609
  (0.770); int8 per channel 0.945/0.961/0.633/0.641 (0.795)."""
from __future__ import annotations

import logging

import torch

from tandem.cpu_kernels import pack_linear

log = logging.getLogger(__name__)


def frequent_token_ids(vocab_size: int, n: int, always: list[int]) -> torch.Tensor:
    """The N most frequent ids, by BPE merge order as the frequency proxy (lower
    id = earlier merge = more frequent), plus the special tokens in `always`."""
    ids = set(range(min(n, vocab_size))) | {t for t in always if 0 <= t < vocab_size}
    return torch.tensor(sorted(ids), dtype=torch.long)


def quantize_int8(module: torch.nn.Module) -> torch.nn.Module:
    """int8 weights, one scale per output channel, and dynamically quantized
    activations, for every nn.Linear of a float32 module."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    return quantize_dynamic(module, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)


class ReducedHead:
    """Logits over a token subset, scattered into a full-vocabulary row (-inf elsewhere)."""

    def __init__(self, lm_head_weight: torch.Tensor, token_ids: torch.Tensor, int8: bool, kernel: str = "native"):
        """kernel: the linear kernel of the rest of the model when not int8
        (tandem.cpu_kernels.resolve_linear): "packed" or "fp16" replace the
        subset's nn.Linear as they do the model's."""
        assert lm_head_weight.ndim == 2 and token_ids.ndim == 1
        self.vocab_size = lm_head_weight.shape[0]
        self.token_ids = token_ids.to(lm_head_weight.device)
        self.input_dtype = torch.float32 if int8 else lm_head_weight.dtype
        linear = torch.nn.Linear(lm_head_weight.shape[1], len(token_ids), bias=False, dtype=self.input_dtype,
                                 device=lm_head_weight.device)
        linear.weight.data = lm_head_weight[self.token_ids].detach().to(self.input_dtype).clone()
        if int8:
            self.linear = quantize_int8(torch.nn.Sequential(linear))[0]
        else:
            self.linear = linear if kernel == "native" else pack_linear(linear, kernel)

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """[hidden] last hidden state → [vocab] float32 logits."""
        assert hidden.ndim == 1, hidden.shape
        sub = self.linear(hidden[None].to(self.input_dtype))[0]
        full = torch.full((self.vocab_size,), float("-inf"), device=sub.device)
        full[self.token_ids] = sub.float()
        return full
