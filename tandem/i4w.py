"""4-bit weights times int8 activations (tandem/i4w.c), on AVX512-VNNI or, where
the CPU lacks it, on AVX2: the int4 draft's kernel on CPUs without AMX. Both
builds take each group's dot product exactly in int32 and fold the groups with
the same float32 operations, so their linear layers give the same bits.

Why: a draft step streams all of the draft's weights for one token, so it costs
what its bytes cost. On a 2-core Zen 4 EPYC VM (AVX512-VNNI, no AMX, one thread;
2026-11-26), all of the default draft's linear layers and its 32k-token head,
one token, distinct weights so that nothing stays cached:
- int8 weights and activations on FBGEMM (quantize_dynamic): 26.8–34.5 ms
  (about 387 MB);
- int4 weights on aten's CPU kernel: slower than int8 there (the draft step
  34.5–36.4 ms against 30.3–33.8: it needs native bf16 matmuls to be fast);
- this kernel: 9.9–10.1 ms (242 MB, codes and fp16 scales: 24 GB/s, about what
  one core of that VM reads).

The weights are those of aten's int4 path (cheap.quantize_groups: groups of 32
input channels, 16 levels between the group's min and max); the group's scale
and low value are held in fp16. The activations are quantized to int8 in the
same groups of 32, each group of each token with its own scale (max|x| / 127),
so a row's output does not depend on the other rows of its forward: a token's
draft probabilities are the same whether it was fed alone or in a catch-up, and
a seeded sampled run gives the same tokens with the pipeline on and off.

Agreement of the draft's greedy token with the float32 target's along the
target's greedy output (4 prompts × 128 tokens, prompt in one forward, then a
token a forward, 32k head; Zen 4 VM, 2026-11-26): float32 0.781, int8 on FBGEMM
0.775, int4 on this kernel 0.768 (the same with one activation scale per token
instead of per group), int4 weights with float32 activations 0.779. Each
hundredth is about 5 of the 512 positions.

The AVX2 build, on a 2-core Zen 3 EPYC VM (no AVX-512; 2026-11-27, one pinned
thread): the same layers and head, one token, 21.9–22.7 ms best of 8 (10.6–11.0
GB/s, against 14.6–18.3 GB/s for a torch sum over as many bytes); the draft step
of the draft service (lean, layers in one C call, 32k head) 21.5–23.7 ms against
56.5–58.8 ms with int8 on FBGEMM, and pinned Tandem back to back ran (b) 18.2%
and (d) 17.1% faster with it (bench/RESULTS.md). On a 2-core Zen 1 EPYC VM
(2026-11-28; each 256-bit operation there is two 128-bit ones) the same layers
took 44–56 ms best of 6–8 for one row and 93–96 ms for two while each block was
read in strided passes, a unit of 16 columns at a time (4.3–5.4 GB/s for one
row, against 13.1 GB/s for a torch sum). Since then the AVX2 build reads each
block front to back, group by group, with a prefetch four groups ahead: 30–32
ms for one row, 45–46 ms for two (the same bits; tandem/i4w.c; `python -m
bench.i4w_probe`).

`layers` runs a Llama-family layer stack on these layers in one C call, for
the draft's lean step (tandem.lean)."""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tandem.ckernel import CKernel, cpu_capability, cpu_features

GROUP = 32  # input channels per scale, fixed in the C source
UNIT = 320  # bytes of one group of 16 columns: 256 of codes, 32 of scales, 32 of low values


AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vnni"]
AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]


def _flags() -> list[str]:
    """The AVX512-VNNI build where the CPU has it, else the AVX2 one (the same
    linear layers bit for bit: tandem/i4w.c). Each build checks the CPU again
    once loaded."""
    capability = cpu_capability()
    features = cpu_features()
    if capability == "AVX512" and features.get("avx512_bw") and features.get("avx512_vnni"):
        return AVX512_FLAGS
    if capability in ("AVX512", "AVX2"):
        return AVX2_FLAGS
    raise RuntimeError("this CPU has neither AVX2 nor AVX-512")


def _declare(lib: ctypes.CDLL) -> None:
    lib.tandem_i4w_supported.argtypes = []
    lib.tandem_i4w_supported.restype = ctypes.c_int
    if not lib.tandem_i4w_supported():
        raise RuntimeError("this CPU lacks the instructions the i4w build needs (AVX512-VNNI, or AVX2, FMA and F16C)")
    lib.tandem_i4w_linear.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.tandem_i4w_linear.restype = None
    lib.tandem_i4w_layers.argtypes = ([ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int] * 6
                                      + [ctypes.c_float] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
                                      + [ctypes.c_void_p] * 2 + [ctypes.c_int])
    lib.tandem_i4w_layers.restype = ctypes.c_int


KERNEL = CKernel("i4w", Path(__file__).with_name("i4w.c"), _flags, _declare)
library, unavailable = KERNEL.library, KERNEL.unavailable


def pack(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (0..15), scale and low [N, K / GROUP] (weight ≈ code·scale + low)
    → the byte layout tandem/i4w.c reads, N % 16 == 0, K % GROUP == 0."""
    rows, cols = codes.shape
    assert rows % 16 == 0 and cols % GROUP == 0, codes.shape
    groups = cols // GROUP
    parts, n = [], 0
    while n < rows:
        width = 64 if n < rows // 64 * 64 else 16  # column blocks of 64, then 16
        vecs = width // 16
        block = codes[n:n + width].to(torch.uint8).reshape(vecs, 16, groups, 4, 2, 4)  # vector, lane, group, quad, half, byte
        block = block.permute(2, 0, 3, 1, 5, 4)  # group, vector, quad, lane, byte, half
        nibbles = (block[..., 0] | (block[..., 1] << 4)).reshape(groups, vecs, 256)
        halves = [t[n:n + width].reshape(vecs, 16, groups).permute(2, 0, 1).to(torch.float16).contiguous()
                  .view(torch.uint8) for t in (scale, low)]  # group, vector, 32 bytes
        parts.append(torch.cat([nibbles, *halves], dim=-1).reshape(-1))
        n += width
    return torch.cat(parts).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
           kernel: CKernel = KERNEL) -> torch.Tensor:
    """x [M, K] float32 contiguous → [M, out_features] float32 (bias float32 or
    None); `kernel`: another build of tandem/i4w.c, for tests."""
    assert x.ndim == 2 and x.dtype == torch.float32 and x.is_contiguous(), (x.shape, x.dtype)
    lib = kernel.library()
    if lib is None:
        raise RuntimeError(f"the i4w kernel is unavailable: {kernel.unavailable()}")
    rows, cols = x.shape  # [M, K]
    assert packed.numel() == out_features * cols * UNIT // (16 * GROUP), (packed.numel(), out_features, cols)
    scratch = torch.empty(rows * (cols + 8 * (cols // GROUP)), dtype=torch.uint8)
    y = torch.empty(rows, out_features)
    lib.tandem_i4w_linear(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                          scratch.data_ptr(), rows, out_features, cols, torch.get_num_threads())
    return y


# The addresses tandem_i4w_layers reads for each layer, in its order (the C enum).
LAYER_SLOTS = ("q", "k", "v", "o", "gate", "up", "down", "q_bias", "k_bias", "v_bias", "o_bias", "gate_bias",
               "up_bias", "down_bias", "norm1", "norm2")


def layers(table: torch.Tensor, x: torch.Tensor, shape: dict, eps: tuple[float, float], keys: torch.Tensor,
           values: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Runs x [M, hidden] float32 through the layers of `table` (int64 [layers,
    len(LAYER_SLOTS)] addresses) in place, writing the rows' keys and values at
    positions start … start + M - 1 of keys, values [layers, kv_heads,
    capacity, head_dim]. shape: hidden, heads, kv_heads, head_dim, intermediate.
    cos, sin: [M, head_dim] float32, the rows' rotary tables."""
    rows, hidden = x.shape
    layer_count, kv_heads, capacity, head_dim = keys.shape
    assert x.dtype == torch.float32 and x.is_contiguous() and hidden == shape["hidden"], (x.shape, x.dtype)
    assert table.dtype == torch.int64 and table.shape == (layer_count, len(LAYER_SLOTS)), table.shape
    assert keys.dtype == values.dtype == torch.float32 and keys.is_contiguous() and values.is_contiguous()
    assert values.shape == keys.shape and kv_heads == shape["kv_heads"] and head_dim == shape["head_dim"]
    assert start + rows <= capacity and cos.shape == sin.shape == (rows, head_dim), (start, rows, capacity, cos.shape)
    assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    lib = library()
    if lib is None:
        raise RuntimeError(f"the i4w kernel is unavailable: {unavailable()}")
    failed = lib.tandem_i4w_layers(table.data_ptr(), layer_count, x.data_ptr(), rows, hidden, shape["heads"], kv_heads,
                                   head_dim, shape["intermediate"], eps[0], eps[1], keys.data_ptr(),
                                   values.data_ptr(), capacity, start, cos.data_ptr(), sin.data_ptr(),
                                   torch.get_num_threads())
    if failed:
        raise MemoryError("tandem_i4w_layers could not allocate its work space")
