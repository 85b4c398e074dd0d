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
token at a time must be timed with nn.Linear too (baseline_configs)."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

LINEAR_KERNELS = ("auto", "native", "packed")


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (oneDNN's own test)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def packed_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def auto_dtype(device: str) -> str:
    """bfloat16 on GPUs and on CPUs with native bf16; float32 (packed) elsewhere."""
    if device.startswith("cuda") or native_bf16():
        return "bfloat16"
    return "float32"


def use_packed(linear: str, device: str, dtype: str) -> bool:
    """Whether a model on `device` in `dtype` gets packed linear layers."""
    if linear == "native" or device != "cpu" or dtype != "float32":
        if linear == "packed":
            raise ValueError("packed linear layers need device cpu and dtype float32")
        return False
    if not packed_available():
        if linear == "packed":
            raise ValueError("this torch build has no oneDNN linear: use --linear native")
        return False
    return True


def baseline_configs(device: str, dtype: str) -> list[tuple[str, str]]:
    """The (dtype, linear) configurations to time the target alone in, for a
    speedup over the fastest of them: the service's own first (the identity
    reference: same weights, same kernels), then nn.Linear where the service's
    layers are packed, and bf16. Even without native bf16, a one-token bf16
    decode is no slower than float32 with nn.Linear (372 vs 381 ms on the AVX2
    machine above), because it reads half the bytes."""
    configs = [(dtype, "auto")]
    if use_packed("auto", device, dtype):
        configs.append((dtype, "native"))
    if dtype != "bfloat16":
        configs.append(("bfloat16", "auto"))
    return configs


def config_label(dtype: str, linear: str) -> str:
    """'float32', 'float32/native', 'bfloat16': how benchmarks name a configuration."""
    return dtype if linear == "auto" else f"{dtype}/{linear}"


def parse_config(label: str) -> tuple[str, str]:
    dtype, _, linear = label.partition("/")
    return dtype, linear or "auto"


class PackedLinear(torch.nn.Module):
    """y = x Wᵀ + b in float32, with W reordered for oneDNN once."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        assert weight.ndim == 2, weight.shape
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] → [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: torch.nn.Module) -> int:
    """Replaces every nn.Linear of a float32 CPU model by a PackedLinear; returns
    how many. A weight shared with another module (a tied lm_head) stays where
    it is for that module; the packed copy is the layer's own."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, PackedLinear(child))
                count += 1
    log.info("packed %d linear layers for oneDNN", count)
    return count
