"""float32 linear layers on weights held in bf16 (`--linear bf16w`, CPUs with AVX-512 or AVX2).

Why: a verify of k+1 tokens multiplies every weight by k+1 rows of
activations. FBGEMM's fp16-weight kernel (cpu_kernels.Fp16Linear) streams
the weights once for one token, but from three tokens on its cost grows by
the FMAs of each row as if the stream were not there: on a 2-core Zen 4 VM
all the default target's linear layers took 107/113/139/166/198 ms for
1/2/3/4/5 tokens, about 57 ms + 27.7 ms a token. A core can stream the
weights while it multiplies, so four tokens should cost little more than
one. tandem/bf16w.c does that: the weights in 16 bits, each pair of input
columns widened to float32 in registers (exact: a bf16 value is a float32
with 16 zero bits), reordered once at load so that a layer reads them front
to back, prefetched ahead, and multiplied with up to 8 rows of activations a
pass. bench/RESULTS.md has the measurements.

Exact where the weights are bf16 values (the default pair's are: it is
dequantized to bf16): the layer computes the float32 nn.Linear function,
summed along the input in order. Each output row is summed the same way
whatever the other rows, so a verify's rows equal one-token decoding's bit
for bit in these layers. A layer whose float32 weights are not all bf16
values keeps the kernel it would have had.

`--linear bf16dot` (tandem/bf16dot.c, CPUs with AVX512-BF16) multiplies the
same packed weights by the activations rounded to bf16, on the CPU's bf16 dot
product: each step adds the two exact products of a pair of input columns to
a float32 sum. It halves the multiply work of a block of tokens, so a verify
costs little more than a one-token decode, and each output row is still
summed the same way whatever the other rows; but the layer is no longer the
float32 nn.Linear function (its inputs lose 16 bits), so the model's greedy
output is its own, and Tandem's is compared with the target alone on the same
kernel (tandem.modeling gives such models row-by-row attention, and the
target verifies a block apart from a prompt before it, so that a verify's
logits equal decoding's bit for bit).

tandem.ckernel builds the C sources once per machine and loads them."""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tandem.ckernel import CKernel, cpu_capability, cpu_features

ISA_FLAGS = {"AVX512": ["-mavx512f"], "AVX2": ["-mavx2", "-mfma"]}  # by torch's CPU capability


def _flags() -> list[str]:
    isa = cpu_capability()
    if isa is None:
        raise RuntimeError("this CPU has neither AVX-512 nor AVX2")
    return ISA_FLAGS[isa]


def _declare(lib: ctypes.CDLL) -> None:
    lib.tandem_bf16w_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.tandem_bf16w_linear.restype = None
    lib.tandem_bf16w_pack.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    lib.tandem_bf16w_pack.restype = None


KERNEL = CKernel("bf16w", Path(__file__).with_name("bf16w.c"), _flags, _declare)
library, unavailable = KERNEL.library, KERNEL.unavailable


def _dot_flags() -> list[str]:
    if cpu_capability() != "AVX512" or not cpu_features().get("avx512_bf16"):
        raise RuntimeError("this CPU has no AVX512-BF16 dot product")
    if KERNEL.library() is None:  # its weights are packed by bf16w's AVX-512 build
        raise RuntimeError(f"the bf16w kernel is unavailable: {KERNEL.unavailable()}")
    return ["-mavx512f", "-mavx512bf16"]


def _dot_declare(lib: ctypes.CDLL) -> None:
    lib.tandem_bf16dot_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.tandem_bf16dot_linear.restype = None


DOT_KERNEL = CKernel("bf16dot", Path(__file__).with_name("bf16dot.c"), _dot_flags, _dot_declare)


def fits(linear: torch.nn.Linear) -> bool:
    """Whether the kernel takes this layer: its shape fits the packing (output
    a multiple of 16, input even) and every weight is a bf16 value."""
    weight = linear.weight.detach()
    if linear.out_features % 16 or linear.in_features % 2 or weight.dtype != torch.float32:
        return False
    return bool((weight.bfloat16().float() == weight).all())


class Bf16wLinear(torch.nn.Module):
    """y = x Wᵀ + b in float32, W held in bf16 and reordered for tandem/bf16w.c."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        lib = library()
        if lib is None:
            raise RuntimeError(f"the bf16w kernel is unavailable: {unavailable()}")
        self._multiply = lib.tandem_bf16w_linear  # (x, packed W, y, M, N, K, threads)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().bfloat16().contiguous()  # [out, in]
        assert weight.ndim == 2, weight.shape
        self.packed = torch.empty(self.out_features * self.in_features // 2, dtype=torch.int32)
        lib.tandem_bf16w_pack(weight.data_ptr(), self.packed.data_ptr(), self.out_features, self.in_features)
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] → [..., out]
        assert x.shape[-1] == self.in_features, (x.shape, self.in_features)
        rows = x.reshape(-1, self.in_features).float().contiguous()  # [M, in]
        y = torch.empty(rows.shape[0], self.out_features)  # [M, out]
        self._multiply(rows.data_ptr(), self.packed.data_ptr(), y.data_ptr(), rows.shape[0], self.out_features,
                       self.in_features, torch.get_num_threads())
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Bf16dotLinear(Bf16wLinear):
    """y = bf16(x) Wᵀ + b, products exact and sums in float32 (tandem/bf16dot.c), W as Bf16wLinear holds it."""

    def __init__(self, linear: torch.nn.Linear):
        dot = DOT_KERNEL.library()
        if dot is None:
            raise RuntimeError(f"the bf16dot kernel is unavailable: {DOT_KERNEL.unavailable()}")
        super().__init__(linear)
        self._multiply = dot.tandem_bf16dot_linear  # the same arguments; it rounds x to bf16 itself
