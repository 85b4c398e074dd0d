"""CPU kernels for the model services: which dtype to compute in, and linear
layers whose weights oneDNN reorders once at load.

Why: on a CPU without native bf16 (no AVX512-BF16, AMX or AVX-NE-CONVERT),
PyTorch's bf16 matmul converts and multiplies row by row, so a forward over n
tokens costs about n one-token decodes, and a verify of k+1 tokens costs k+1
decodes: speculation cannot win. oneDNN's float32 matmul on weights reordered
once at load costs about the same as a bf16 decode for one token and grows
slowly with n (measured on a 2-core AVX2 EPYC, Qwen2.5-1.5B, one thread:
1 token 527 ms, 4 tokens 779 ms, 8 tokens 808 ms; bf16: 441, 1264, 2553 ms).
The packed layers compute the same float32 function as nn.Linear (only the
summation order differs, as between any two BLAS kernels). For one token
alone, plain nn.Linear (MKL's matrix-vector product) is faster still: 381–396
ms against 537–569 ms on that machine, but 1066–1086 ms against 709–792 ms for 4. So a
target service, which verifies blocks, packs; a baseline that decodes one
token at a time must be timed with nn.Linear too (baseline_configs).

Faster still, where it is exact: FBGEMM's GEMM on weights stored in fp16,
computed in float32 (`Fp16Linear`, `--linear fp16`). bf16 weights of a row
scaled by a power of two usually convert to fp16 without losing a bit (bf16
has 7 mantissa bits, fp16 10, and the row's range fits fp16's exponents), so
the layer computes exactly the float32 nn.Linear function, reading half the
bytes. Every weight is checked at load; a layer that would lose one keeps the
packed float32 kernel. Same AVX2 machine, one thread, 8960×1536 layer:
1/4/6 tokens 2.6/3.8/3.5 ms against 4.5/17.3/19.3 (nn.Linear) and 6.6/10.2/9.9
(packed); the 151936-row output layer 36/49/51 ms against 68/287/295 and
74/143/137. FBGEMM's AVX2 kernel multiplies up to 6 rows of x per pass over
the weights, so a verify of up to 6 tokens streams them once.

With AMX (Sapphire Rapids and later), bf16 on weights reordered for oneDNN
once at load (`PackedLinear` on bf16 weights) beats them all, and its cost
barely grows with the tokens of a forward: a verify costs what a decode costs.
2-core Xeon with AMX-BF16, one thread, the default target's whole forward over
1/4/6/8 tokens (after a 60-token prompt): bf16 packed 270/276/279/280 ms;
float32 on fp16 weights 286/381/420/– ms; bf16 nn.Linear 360/351/351/– ms.
One 8960×1536 layer, 1/4/6 tokens: 1.16/1.17/1.17 ms packed bf16 against
1.07/1.29/1.47 fp16 weights and 2.0/1.7/1.7 bf16 nn.Linear; the 151936-row
output layer 35.8/35.8/35.4 against 35.9/51.2/58.5 and 44.5/47.4/47.7. So
auto_dtype picks bf16 where the CPU has AMX, and resolve_linear packs bf16
where the CPU multiplies bf16 natively.

For float32, tandem/bf16w.c (`--linear bf16w`; tandem.bf16w says why)
verifies blocks for less than FBGEMM: FBGEMM's cost grows by each token's
FMAs from three tokens on, and bf16w overlaps them with the weights' stream.
All the default target's layers, one thread: on a Zen 4 VM (AVX-512) 4
tokens 120 ms against 165; on a 2-core AVX2 EPYC VM without AVX-512,
1/2/3/4/6 tokens 274/299/363/472/723 ms against 378/437/529/566/780. On
CPUs with AVX2 and no AVX-512 it was faster: there the target alone
decoded 2.80 tok/s on it against 2.10 on FBGEMM, and pinned pipelined Tandem
ran faster on it too. With AVX-512, in two runs side by side on a Zen 4 VM,
the target alone decoded as fast on it as on FBGEMM (7.35-7.39 tok/s against
6.97-7.48), and pinned Tandem ran 6.0-12.8% faster on it, its verify of 3+1
tokens 160 ms against 194 (bench/RESULTS.md). But on a Zen 4 VM whose
hypervisor hides AVX-512 FBGEMM was the faster (tandem.linear_choice), so
`auto` measures the two once on each machine (bf16w_preferred)."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

LINEAR_KERNELS = ("auto", "native", "packed", "fp16", "bf16w", "bf16dot")


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (oneDNN's own test)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def amx_bf16() -> bool:
    """Whether this CPU has AMX tiles with bf16 (where packed bf16 wins, above)."""
    try:
        return bool(torch.cpu._is_amx_tile_supported()) and native_bf16()
    except (AttributeError, RuntimeError):
        return False


def packed_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def auto_dtype(device: str) -> str:
    """bfloat16 on GPUs. On a CPU with AMX-BF16, bfloat16 on packed layers (the
    module docstring's measurements), even where float32 on bf16w decodes one
    token faster: on a 2-core AMX Xeon (model 167) pinned pipelined Tandem ran
    7.12-8.27 tok/s on bf16 against 4.52-5.53 on bf16w, three pairs of runs
    (bench/RESULTS.md, a010dfa). Else float32 on bf16w or fp16-weight
    layers where either runs (resolve_linear picks which), even where the CPU
    has native bf16 without AMX: on a 2-core AVX512-BF16 EPYC, one thread, the default target alone decoded 8.64 tok/s
    against 4.30 in bf16 on nn.Linear (2 prompts × 48 tokens), and on a Zen 4
    EPYC with AVX512-BF16 packed bf16 verified 4-6 tokens for less but decoded
    one slower, and pipelined Tandem ran no faster in it (9.45 tok/s against
    9.62, bench/RESULTS.md). Else bfloat16 with native bf16, float32 (packed) without."""
    if device.startswith("cuda"):
        return "bfloat16"
    if amx_bf16() and packed_available():
        return "bfloat16"
    if (fp16_available() and packed_available()) or bf16w_available():
        return "float32"
    return "bfloat16" if native_bf16() else "float32"


def fp16_available() -> bool:
    return hasattr(torch.ops.quantized, "linear_prepack_fp16") and "fbgemm" in torch.backends.quantized.supported_engines


def bf16w_available() -> bool:
    """Whether tandem/bf16w.c runs here (AVX2 + FMA or AVX-512, and a C compiler)."""
    from tandem import bf16w
    return bf16w.unavailable() is None


def bf16w_preferred(threads: int = 0) -> bool:
    """Whether `auto` runs float32 layers on tandem/bf16w.c: where it runs,
    unless FBGEMM's fp16 layers run too and measure faster on this machine at
    these threads (0: torch's), once (tandem.linear_choice). bf16w decoded
    one token as fast as FBGEMM or faster, and verified blocks for less, on an
    AVX2 VM and a Zen 4 VM (the module docstring), but not on a Zen 4 VM whose
    AVX-512 the hypervisor hides."""
    if not bf16w_available():
        return False
    if not (fp16_available() and packed_available()):
        return True
    from tandem.linear_choice import faster_float32_kernel
    return faster_float32_kernel(threads or torch.get_num_threads()) == "bf16w"


def resolve_linear(linear: str, device: str, dtype: str, threads: int = 0) -> str:
    """The kernel a model on `device` in `dtype` gets for `linear`: "native"
    (nn.Linear), "packed" (oneDNN) or "fp16" (FBGEMM on fp16 weights, packed
    where a layer's weights do not convert exactly). "auto": the fastest that
    applies, bf16w (where bf16w_preferred, at `threads`) > fp16 > packed >
    native for float32 on a CPU; for bfloat16 on a CPU, packed where it
    multiplies bf16 natively, else native. Raises on a choice that cannot apply."""
    if linear == "native":
        return "native"
    if device == "cpu" and dtype == "bfloat16" and linear in ("auto", "packed"):
        if packed_available() and native_bf16():
            return "packed"
        if linear == "packed":
            raise ValueError("packed bfloat16 linear layers need a CPU with native bf16 (AVX512-BF16 or AMX) "
                             "and oneDNN: use --linear native or --dtype float32")
        return "native"
    if device != "cpu" or dtype != "float32":
        if linear != "auto":
            raise ValueError(f"{linear} linear layers need device cpu and dtype float32")
        return "native"
    if linear == "bf16w":
        from tandem import bf16w
        if (why := bf16w.unavailable()) is not None:
            raise ValueError(f"bf16w linear layers cannot run here: {why}; use --linear fp16, packed or native")
        return "bf16w"
    if linear == "bf16dot":
        from tandem import bf16w
        if (why := bf16w.DOT_KERNEL.unavailable()) is not None:
            raise ValueError(f"bf16dot linear layers cannot run here: {why}; use --linear bf16w, fp16, packed or native")
        return "bf16dot"
    if linear == "auto" and bf16w_preferred(threads):
        return "bf16w"
    if linear in ("auto", "fp16") and fp16_available() and packed_available():
        return "fp16"
    if linear == "fp16":
        raise ValueError("this torch build has no FBGEMM fp16 linear (or no oneDNN): use --linear packed or native")
    if packed_available():
        return "packed"
    if linear == "packed":
        raise ValueError("this torch build has no oneDNN linear: use --linear native")
    return "native"


def baseline_configs(device: str, dtype: str, linear: str = "auto",
                     extra: list[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """The (dtype, linear) configurations to time the target alone in, for a
    speedup over the fastest of them: the service's own first (the identity
    reference: same weights, same kernels; `linear` is its --linear), then, on
    a CPU, float32 on its fastest layers, on FBGEMM's fp16 layers and on bf16w
    where auto picks others (it measures them at its own threads:
    tandem.linear_choice), float32 nn.Linear (MKL's one-row product wins on one-token
    decoding where the service packs) and bf16; on a GPU, bf16. Each set of
    kernels once, `extra` (asked for by hand) last. Even without native bf16, a one-token bf16 decode is no slower
    than float32 with nn.Linear (372 vs 381 ms on the AVX2 machine above),
    because it reads half the bytes; with it, float32 on fp16 weights still
    decodes twice as fast (auto_dtype)."""
    others = [("float32", "auto"), ("float32", "fp16"), ("float32", "bf16w"), ("float32", "native"), ("bfloat16", "auto")] \
        if device == "cpu" else [("bfloat16", "auto")]
    configs = [(dtype, linear)]
    for candidate in [*others, *extra]:
        kernels = {(d, resolve_linear(linear, device, d)) for d, linear in configs}
        try:
            kernel = resolve_linear(candidate[1], device, candidate[0])
        except ValueError:  # e.g. no FBGEMM in this torch build; one asked for by hand says why
            if candidate in extra:
                raise
            continue
        if (candidate[0], kernel) not in kernels:
            configs.append(candidate)
    return configs


def config_label(dtype: str, linear: str) -> str:
    """'float32', 'float32/native', 'bfloat16': how benchmarks name a configuration."""
    return dtype if linear == "auto" else f"{dtype}/{linear}"


def parse_config(label: str) -> tuple[str, str]:
    dtype, _, linear = label.partition("/")
    return dtype, linear or "auto"


class PackedLinear(torch.nn.Module):
    """y = x Wᵀ + b in W's dtype (float32 or bfloat16), with W reordered for
    oneDNN once."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach()  # [out, in]
        assert weight.ndim == 2, weight.shape
        if weight.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"packed linear layers are float32 or bfloat16, not {weight.dtype}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        self.bias = None if linear.bias is None else linear.bias.detach().to(weight.dtype).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] → [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def exact_fp16(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(fp16-exact float32 weight, per-row power-of-two scale or None) such that
    weight == result / scale bit for bit, or None if some weight would lose bits.
    Unscaled first; else each row scaled so that its largest |w| lies in
    [2^14, 2^15), which keeps fp16's full mantissa for the row's small weights
    down to 2^-28 of its largest."""
    if _fp16_normal_exact(weight):
        return weight, None
    amax = weight.abs().amax(dim=1, keepdim=True)
    exponent = torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax))))
    scale = torch.exp2(14 - exponent)  # [out, 1], exact powers of two
    scaled = weight * scale
    if not _fp16_normal_exact(scaled):
        return None
    return scaled, scale[:, 0]


FP16_MIN_NORMAL = 2.0**-14


def _fp16_normal_exact(weight: torch.Tensor) -> bool:
    """Every value converts to fp16 and back unchanged, and none is an fp16
    subnormal (which a kernel might flush to zero)."""
    return bool(((weight.half().float() == weight) & ((weight == 0) | (weight.abs() >= FP16_MIN_NORMAL))).all())


class Fp16Linear(torch.nn.Module):
    """y = x Wᵀ + b computed in float32 by FBGEMM on W stored in fp16, for a W
    whose every value converts exactly (exact_fp16): the float32 nn.Linear
    function, summed in another order, reading half the bytes."""

    def __init__(self, linear: torch.nn.Linear, exact: tuple[torch.Tensor, torch.Tensor | None]):
        super().__init__()
        weight, scale = exact
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.contiguous(), None)
        self.inv_scale = None if scale is None else (1.0 / scale).contiguous()  # exact: powers of two
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] → [..., out]
        y = torch.ops.quantized.linear_dynamic_fp16(x, self.packed)
        if self.inv_scale is not None:
            y = y * self.inv_scale
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, row_scaled={self.inv_scale is not None}")


def pack_linear(linear: torch.nn.Linear, kernel: str = "packed") -> torch.nn.Module:
    """The replacement of one nn.Linear: a PackedLinear; for kernel="fp16" an
    Fp16Linear where its weights convert exactly (else a PackedLinear); for
    kernel="bf16w" a Bf16wLinear where they are bf16 values (else as for
    "fp16"), and for "bf16dot" a Bf16dotLinear there."""
    if kernel not in ("packed", "fp16", "bf16w", "bf16dot"):
        raise ValueError(f"kernel must be 'packed', 'fp16', 'bf16w' or 'bf16dot', got {kernel!r}")
    if kernel in ("bf16w", "bf16dot"):
        from tandem import bf16w
        if bf16w.fits(linear):
            return bf16w.Bf16dotLinear(linear) if kernel == "bf16dot" else bf16w.Bf16wLinear(linear)
        kernel = "fp16" if fp16_available() else "packed"
    exact = exact_fp16(linear.weight.detach().float()) if kernel == "fp16" else None
    return Fp16Linear(linear, exact) if exact is not None else PackedLinear(linear)


def replace_linears(model: torch.nn.Module, make) -> list[torch.nn.Module]:
    """Replaces each nn.Linear in `model` by make(layer), where that returns a
    module (None keeps the layer); returns the replacements."""
    made = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and (replacement := make(child)) is not None:
                setattr(parent, name, replacement)
                made.append(replacement)
    return made


def pack_linears(model: torch.nn.Module, kernel: str = "packed") -> int:
    """Replaces every nn.Linear of a float32 or bfloat16 CPU model by a PackedLinear, or for
    kernel="fp16" by an Fp16Linear where its weights convert exactly (else a
    PackedLinear); returns how many layers it replaced. A weight shared with
    another module (a tied lm_head) stays where it is for that module; the
    replacement holds its own copy."""
    made = replace_linears(model, lambda layer: pack_linear(layer, kernel))
    names = ("Bf16dotLinear" if kernel == "bf16dot" else "Bf16wLinear", "Fp16Linear", "PackedLinear")
    kinds = {name: sum(type(m).__name__ == name for m in made) for name in names}
    if kernel in ("bf16w", "bf16dot"):
        log.info("%d linear layers on bf16 weights (tandem/%s.c), %d on fp16 weights (FBGEMM), %d packed for "
                 "oneDNN (their weights are not bf16 values)", kinds[names[0]], kernel, kinds["Fp16Linear"],
                 kinds["PackedLinear"])
    elif kernel == "fp16":
        log.info("%d linear layers on fp16 weights (FBGEMM), %d packed for oneDNN "
                 "(their weights do not convert to fp16 exactly)", kinds["Fp16Linear"], kinds["PackedLinear"])
    else:
        log.info("packed %d linear layers for oneDNN", len(made))
    return len(made)
