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

The C source is compiled once per machine with the system's C compiler
(`cc`, or $CC) into $TANDEM_KERNEL_CACHE (default ~/.cache/tandem/kernels)
and loaded with ctypes, which releases the GIL for the call."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bf16w.c")
COMMON_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
ISA_FLAGS = {"AVX512": ["-mavx512f"], "AVX2": ["-mavx2", "-mfma"]}  # by torch's CPU capability
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None


def cpu_capability() -> str | None:
    """"AVX512" or "AVX2" (with FMA), what torch's dispatcher found; None for
    a CPU the kernel has no build for."""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return None
    return capability if capability in ISA_FLAGS else None


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_KERNEL_CACHE") or Path.home() / ".cache" / "tandem" / "kernels")


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None (and why in unavailable())
    where the CPU or the machine cannot run it."""
    global _library, _failure
    with _lock:
        if _library is not None or _failure is not None:
            return _library
        try:
            _library = _build_and_load()
        except (OSError, subprocess.CalledProcessError, RuntimeError) as err:
            _failure = str(err)
            log.info("bf16w kernel unavailable: %s", _failure)
        return _library


def unavailable() -> str | None:
    """Why the kernel cannot run here, or None."""
    library()
    return _failure


def _build_and_load() -> ctypes.CDLL:
    isa = cpu_capability()
    if isa is None:
        raise RuntimeError("this CPU has neither AVX-512 nor AVX2")
    flags = [*COMMON_FLAGS, *ISA_FLAGS[isa]]
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC) to build it with")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([cc, *flags]).encode()).hexdigest()[:16]
    target = cache_dir() / f"bf16w-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run([cc, *flags, str(SOURCE), "-o", str(built)], capture_output=True, text=True)
            if result.returncode:
                raise RuntimeError(f"{cc} failed to build {SOURCE.name}: {result.stderr.strip()[-500:]}")
            os.replace(built, target)  # atomic: another process may build it at the same time
        log.info("built the bf16w kernel (%s): %s", isa, target)
    lib = ctypes.CDLL(str(target))
    lib.tandem_bf16w_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.tandem_bf16w_linear.restype = None
    lib.tandem_bf16w_pack.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    lib.tandem_bf16w_pack.restype = None
    return lib


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
            raise RuntimeError(f"the bf16w kernel is unavailable: {_failure}")
        self._lib = lib
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
        self._lib.tandem_bf16w_linear(rows.data_ptr(), self.packed.data_ptr(), y.data_ptr(), rows.shape[0],
                                      self.out_features, self.in_features, torch.get_num_threads())
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
