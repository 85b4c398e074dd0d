"""Which kernel `--linear auto` gives float32 layers on a CPU where both
tandem/bf16w.c and FBGEMM's fp16 layers run: the one that measures faster on
this machine, once (tandem.cpu_kernels.resolve_linear).

Neither wins everywhere. On a 2-core AVX2 EPYC VM, one thread, the default
target decoded 2.80 tok/s on bf16w against 2.10 on FBGEMM; on a Zen 4 VM
whose hypervisor hides AVX-512 (AVX2 only), its forward over 1 / 4 tokens
took 182-200 / 279-309 ms on bf16w against 140-147 / 229-239 on FBGEMM, and
`make bench-nodes` verified 3+1 tokens in 288 ms, 1.78 one-token decodes of
the target alone on FBGEMM (bench/RESULTS.md, b4296e8).

The measurement: layers of the default target's MLP shapes (8960×1536 and
1536×8960, alternating), with bf16 weights that convert to fp16 exactly, in
all at least 256 MB and four times the last-level cache, so that their
weights stream from memory as a model's do; 1 and 4 rows (a decode, a
verify), alternating kernels, the median of 7 passes. (With 157 MB and 3
passes, two threads on a 2-core VM chose one kernel, then the other.) FBGEMM is chosen only where it is faster by
more than MARGIN, since bf16w verifies blocks for less where the two are
close. It takes a few seconds, and is kept per machine (CPU model and flags,
torch version, threads) in the model cache, so a service measures once.
TANDEM_LINEAR_AUTO=bf16w|fp16 skips it."""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import statistics
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SHAPES = ((8960, 1536), (1536, 8960))  # (out, in): the default target's MLP projections, up and down
MIN_BYTES = 256 << 20  # of bf16 weights, and at least four times the last-level cache
MAX_LAYERS = 24
PASSES = 7
METHOD = 2  # part of the kept choice's key: a new measurement replaces the old ones
MARGIN = 0.95  # FBGEMM's time over bf16w's below which it is chosen
KERNELS = ("bf16w", "fp16")


def choose(ms: dict[str, dict[int, float]]) -> str:
    """The kernel for these median times (kernel → rows → ms)."""
    total = {kernel: sum(by_rows.values()) for kernel, by_rows in ms.items()}
    return "fp16" if total["fp16"] < MARGIN * total["bf16w"] else "bf16w"


@functools.cache
def faster_float32_kernel(threads: int) -> str:
    """"bf16w" or "fp16": the environment's choice, this machine's kept one,
    or a new measurement (kept)."""
    given = os.environ.get("TANDEM_LINEAR_AUTO", "")
    if given in KERNELS:
        return given
    if given:
        raise ValueError(f"TANDEM_LINEAR_AUTO must be one of {', '.join(KERNELS)}, got {given!r}")
    key = _machine_key(threads)
    kept = _read().get(key)
    if kept in KERNELS:
        return kept
    started = time.perf_counter()
    ms = measure(threads)
    choice = choose(ms)
    log.info("--linear auto: float32 layers on %s (1 / 4 rows over %d MB of weights, %d threads: bf16w %.1f / %.1f ms, "
             "FBGEMM fp16 %.1f / %.1f ms; measured in %.1f s, kept in %s)", choice, _layers() * LAYER_BYTES >> 20,
             threads, ms["bf16w"][1], ms["bf16w"][4], ms["fp16"][1], ms["fp16"][4], time.perf_counter() - started,
             _path())
    _write(key, choice)
    return choice


def measure(threads: int) -> dict[str, dict[int, float]]:
    """Median ms of one pass of 1 and 4 rows through the layers, per kernel."""
    from tandem.bf16w import Bf16wLinear
    from tandem.cpu_kernels import Fp16Linear, exact_fp16

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        stacks: dict[str, list[torch.nn.Module]] = {kernel: [] for kernel in KERNELS}
        for index in range(_layers()):
            out_features, in_features = SHAPES[index % len(SHAPES)]
            weight = torch.randn(out_features, in_features, generator=generator) * 0.02
            weight = torch.where(weight.abs() < 1e-3, torch.full_like(weight, 1e-3).copysign(weight), weight)
            linear = torch.nn.Linear(in_features, out_features, bias=False)
            linear.weight.data = weight.bfloat16().float()  # bf16 values, exact in fp16
            stacks["bf16w"].append(Bf16wLinear(linear))
            stacks["fp16"].append(Fp16Linear(linear, exact_fp16(linear.weight.data)))
        times: dict[str, dict[int, list[float]]] = {kernel: {1: [], 4: []} for kernel in KERNELS}
        inputs = {(rows, n): torch.randn(rows, n, generator=generator) for rows in (1, 4) for _, n in SHAPES}
        with torch.inference_mode():
            for timed in [False] + [True] * PASSES:
                for rows in (1, 4):
                    for kernel, stack in stacks.items():
                        start = time.perf_counter()
                        for layer in stack:
                            layer(inputs[rows, layer.in_features])
                        if timed:
                            times[kernel][rows].append((time.perf_counter() - start) * 1e3)
        return {kernel: {rows: statistics.median(ms) for rows, ms in by_rows.items()} for kernel, by_rows in times.items()}
    finally:
        torch.set_num_threads(before)


LAYER_BYTES = SHAPES[0][0] * SHAPES[0][1] * 2  # of a layer's bf16 weights


def _layers() -> int:
    """Layers of at least MIN_BYTES and four times the last-level cache, at most MAX_LAYERS."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    cache = max(sizes, default=32 << 20)
    return min(MAX_LAYERS, math.ceil(max(MIN_BYTES, 4 * cache) / LAYER_BYTES))


def _machine_key(threads: int) -> str:
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = "".join(line for line in f.read().split("\n\n")[0].splitlines(True)
                          if line.startswith(("model name", "flags", "cpu family", "model\t", "stepping")))
    except OSError:
        pass
    return hashlib.sha256(f"{cpu}|{torch.__version__}|{threads}|{METHOD}".encode()).hexdigest()[:16]


def _path() -> Path:
    from tandem.default_models import model_cache_dir

    return model_cache_dir() / "linear-choice.json"


def _read() -> dict:
    try:
        return json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}


def _write(key: str, choice: str) -> None:
    """Kept beside the others, atomically (several services may start at once)."""
    path = _path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = {**_read(), key: choice}
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(kept))
        temporary.replace(path)
    except OSError as err:
        log.warning("--linear auto: could not keep the choice in %s (%s); it is measured again next time", path, err)
