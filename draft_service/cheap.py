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
  (0.770); int8 per channel 0.945/0.961/0.633/0.641 (0.795).
- int4 weights (Int4Linear): groups of 32 input channels with their own scale
  and offset, bf16 activations, aten's CPU int4 kernel. No activation
  quantization, so a token's probabilities do not depend on which tokens
  shared its forward. On a 2-core Xeon with AMX (2026-11-24), one thread,
  against the bf16 target's greedy output (same 4 prompts, 32k head): int8
  per channel 0.922/0.945/0.636/0.641 (mean 0.786), draft step 43.5 ms; int4
  g32 0.922/0.961/0.610/0.648 (0.785), 34.3 ms; int4 g64 0.780, 32.9 ms; int4
  g128 0.768, 32.4 ms. The kernel is fast only with native bf16: the same
  layers took 25 ms in bf16 and 582 ms with float32 activations there.
  Wherever tandem/i4w.c runs (AVX512-VNNI, or AVX2 where the CPU lacks it),
  AMX CPUs included, the same weights run there by default instead, times
  activations quantized to int8 one token at a time, in groups of 32 (so a
  token's probabilities still do not depend on which tokens shared its
  forward); tandem/i4w.py has its measurements. aten's kernel stays for other
  CPUs and for --int4-kernel aten."""
from __future__ import annotations

import logging

import torch

from tandem import i4w
from tandem.cpu_kernels import pack_linear, replace_linears

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


INT4_GROUP = 32  # input channels per int4 scale: g32 kept int8's agreement, g128 lost 1.8 points (above)
# The int4 kernel multiplies row by row: one layer of 4864×896 took 0.23 ms for 1
# row, 1.6 ms for 16 and 51 ms for 512, against 0.22 / 0.39 / 12.8 ms with fbgemm's
# int8 (one thread, AMX Xeon). Forwards of more rows than this (a prompt's prefill,
# a new chat turn) take an int8 copy of the layer; drafting steps and catch-ups stay int4.
INT4_WIDE_ROWS = 16
QUANTIZE = ("none", "int8", "int4", "auto")


def auto_quantize(device: str) -> str:
    """--quantize auto: int4 where tandem/i4w.c runs (AVX512-VNNI or AVX2) or
    on a CPU with AMX (aten's kernel), where each was measured faster than int8;
    int8 on other CPUs (aten's int4 kernel needs native bf16 to be fast at all,
    and on a Zen 4 EPYC with AVX512-BF16 but no AMX it stepped in 34.5-36.4 ms
    against int8's 30.3-33.8: bench/RESULTS.md); none on a GPU."""
    from tandem.cpu_kernels import amx_bf16

    if device != "cpu":
        return "none"
    return "int4" if int4_kernel() == "i4w" or amx_bf16() else "int8"


INT4_KERNELS = ("auto", "i4w", "aten")


def int4_kernel(choice: str = "auto") -> str:
    """Which kernel Int4Linear multiplies with: `choice`, or for "auto"
    tandem/i4w.c wherever it runs (AVX512-VNNI or AVX2), else aten's. With the
    draft's layers in one C call (tandem.lean), i4w's step is the cheaper
    one on AMX too: on a 2-core Xeon VM with AMX, one pinned thread, 32k head,
    20.07 ms against aten's 35.96 alone, and 20.32 against 36.11 and 36.51 beside
    the target's verifies on the other core (bench/RESULTS.md)."""
    if choice not in INT4_KERNELS:
        raise ValueError(f"int4 kernel must be one of {INT4_KERNELS}, got {choice!r}")
    if choice == "aten":
        return choice
    reason = i4w.unavailable()
    if choice == "i4w" and reason is not None:
        raise ValueError(f"the i4w int4 kernel does not run here: {reason}")
    return "i4w" if reason is None else "aten"


class Int4Linear(torch.nn.Module):
    """An nn.Linear with 4-bit weights: each row in groups of `group` input
    channels, each group with its own scale and offset (asymmetric min/max
    rounding), multiplied by one of two kernels:
    - "aten": packed once at load for aten's CPU int4 kernel
      (_weight_int4pack_mm_for_cpu, the op under torchao's CPU int4 layout,
      which torchao 0.18 keeps in its prototype tree). Activations and output
      are bf16. Output rows are padded to the kernel's multiple of 16 and cut
      off again.
    - "i4w": tandem/i4w.c, the same weights (scales held in fp16) times
      activations quantized to int8 a row (token) at a time, in groups of 32;
      float32 in and out.
    A forward of more than `wide_rows` rows runs an int8 copy of the layer
    (quantize_int8) instead; None keeps no copy."""

    def __init__(self, linear: torch.nn.Linear, group: int = INT4_GROUP, wide_rows: int | None = INT4_WIDE_ROWS,
                 kernel: str | None = None):
        super().__init__()
        kernel = kernel or int4_kernel()
        if kernel not in ("aten", "i4w"):
            raise ValueError(f"int4 kernel must be 'aten' or 'i4w', got {kernel!r}")
        if kernel == "i4w" and group != i4w.GROUP:
            raise ValueError(f"the i4w int4 kernel takes groups of {i4w.GROUP}, not {group}")
        weight = linear.weight.detach().float()
        out_features, in_features = weight.shape
        if in_features % group:
            raise ValueError(f"int4: {in_features} input channels are not a multiple of the group size {group}")
        self.in_features, self.out_features, self.group, self.kernel = in_features, out_features, group, kernel
        self.padded_out = out_features + (-out_features) % 16  # the kernels' multiple of 16
        padded = torch.cat([weight, weight.new_zeros(self.padded_out - out_features, in_features)])
        codes, scale, low = quantize_groups(padded, group)
        if kernel == "i4w":
            self.register_buffer("packed", i4w.pack(codes, scale, low))
            self.output_dtype = torch.float32
        else:
            self.register_buffer("packed",
                                 torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))
            # The kernel computes (code - 8) * scale + zero per weight: zero is the group's value at code 8.
            zero = low + 8 * scale
            self.register_buffer("scales_and_zeros",
                                 torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16))
            self.output_dtype = torch.bfloat16
        bias = None if linear.bias is None else linear.bias.detach().to(self.output_dtype)
        if bias is not None and kernel == "i4w":
            bias = torch.cat([bias, bias.new_zeros(self.padded_out - out_features)])
        self.register_buffer("bias", bias)
        self.wide_rows = wide_rows
        self.wide = None
        if wide_rows is not None:
            wide = torch.nn.Linear(in_features, out_features, bias=linear.bias is not None)
            wide.weight.data = weight.clone()
            if linear.bias is not None:
                wide.bias.data = linear.bias.detach().float().clone()
            self.wide = quantize_int8(torch.nn.Sequential(wide))[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] → [..., out], output_dtype
        flat = x.reshape(-1, self.in_features)
        if self.wide is not None and flat.shape[0] > self.wide_rows:
            return self.wide(flat.float()).to(self.output_dtype).reshape(*x.shape[:-1], self.out_features)
        if self.kernel == "i4w":
            y = i4w.linear(flat.float().contiguous(), self.packed, self.bias, self.padded_out)
            return y[:, : self.out_features].reshape(*x.shape[:-1], self.out_features)
        flat = flat.to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales_and_zeros)
        y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, int4 "
                f"({self.kernel})" + (f", int8 above {self.wide_rows} rows" if self.wide is not None else ""))


def quantize_groups(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] float → (codes 0..15 [out, in], scale [out, in/group], low [out, in/group]):
    weight ≈ codes * scale + low, per group of `group` input channels."""
    rows, cols = weight.shape
    groups = weight.reshape(rows, cols // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
    return codes.reshape(rows, cols).to(torch.uint8), scale, low


def quantize_int4(module: torch.nn.Module, group: int = INT4_GROUP, kernel: str | None = None) -> torch.nn.Module:
    """Replaces every nn.Linear of `module` whose input width is a multiple of
    `group` with an Int4Linear (on `kernel`, by default int4_kernel()); the
    others stay as they are (logged)."""
    kernel = kernel or int4_kernel()
    kept = []

    def make(layer: torch.nn.Linear) -> Int4Linear | None:
        if layer.in_features % group:
            kept.append(layer)
            return None
        return Int4Linear(layer, group, kernel=kernel)

    replace_linears(module, make)
    if kept:
        log.info("int4: %d linear layers kept unquantized (input widths %s, not multiples of %d)",
                 len(kept), sorted({layer.in_features for layer in kept}), group)
    return module


class ReducedHead:
    """Logits over a token subset, scattered into a full-vocabulary row (-inf elsewhere)."""

    def __init__(self, lm_head_weight: torch.Tensor, token_ids: torch.Tensor, quantize: str = "none",
                 kernel: str = "native", int4: str | None = None):
        """quantize: "int8" or "int4" as the rest of the draft, else "none";
        kernel: the linear kernel of the rest of the model when not quantized
        (tandem.cpu_kernels.resolve_linear): "packed" or "fp16" replace the
        subset's nn.Linear as they do the model's; int4: Int4Linear's kernel
        (default int4_kernel())."""
        assert lm_head_weight.ndim == 2 and token_ids.ndim == 1
        self.vocab_size = lm_head_weight.shape[0]
        token_ids = token_ids.unique(sorted=True)  # ascending: the order of a sparse Distribution's ids
        self.token_ids = token_ids.to(lm_head_weight.device)
        self.ids_i32 = token_ids.cpu().numpy().astype("<i4").tobytes()  # SubsetDist.ids_i32, packed once
        int4 = int4 or int4_kernel()
        int4_input = torch.bfloat16 if quantize == "int4" and int4 == "aten" else torch.float32
        self.input_dtype = {"int8": torch.float32, "int4": int4_input}.get(quantize, lm_head_weight.dtype)
        linear = torch.nn.Linear(lm_head_weight.shape[1], len(token_ids), bias=False, dtype=self.input_dtype,
                                 device=lm_head_weight.device)
        linear.weight.data = lm_head_weight[self.token_ids].detach().to(self.input_dtype).clone()
        if quantize == "int8":
            self.linear = quantize_int8(torch.nn.Sequential(linear))[0]
        elif quantize == "int4" and linear.in_features % INT4_GROUP == 0:
            self.linear = Int4Linear(linear, wide_rows=None, kernel=int4)  # one row per call
        else:
            self.linear = linear if kernel == "native" else pack_linear(linear, kernel)

    def rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] hidden states → [rows, vocab] float32 logits (several sessions' steps at once)."""
        return self.scatter(self.subset_rows(hidden))

    @torch.inference_mode()
    def subset_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] hidden states → [rows, len(token_ids)] float32 logits
        of the subset's tokens, in the order of token_ids (ascending)."""
        assert hidden.ndim == 2, hidden.shape
        return self.linear(hidden.to(self.input_dtype)).float()

    @torch.inference_mode()
    def scatter(self, sub: torch.Tensor) -> torch.Tensor:
        """[rows, len(token_ids)] subset logits → [rows, vocab], -inf elsewhere."""
        full = torch.full((sub.shape[0], self.vocab_size), float("-inf"), device=sub.device)
        full[:, self.token_ids] = sub
        return full
