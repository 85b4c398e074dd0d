"""A CPU model's weights on transparent huge pages (Linux).

A decode step on a CPU streams every weight of the model through the caches,
and with 4 KiB pages it also walks a page table for every 4 KiB of them: a
3 GB target is 750,000 pages a token, each a TLB miss, and in a VM each miss is
a two-level walk (the guest's table, then the host's). With 2 MiB pages the
walks are 512 times fewer. Measured on a 2-core Xeon VM (bench/RESULTS.md),
one process holding the default target twice, one copy collapsed onto huge
pages, forwards alternated: the copy on huge pages was faster in the median of
the paired forwards, where the same two copies with neither collapsed were
not.

Where this runs, the weights are already in memory (loaded, packed,
quantized), in allocations that Python cannot name: oneDNN's packed weights
are opaque tensors. So `collapse()` works on the process's memory map instead:
each anonymous read-write mapping of at least 2 MiB that is nearly all
resident is collapsed in place with madvise(MADV_COLLAPSE) (Linux 6.1 and
later; it copies the pages into huge ones and keeps their contents). Mostly
empty mappings (thread stacks, arena reserves) are left alone, since a
collapse would fill them. The contents never change, so neither does any
output: this is memory placement only.
"""
from __future__ import annotations

import ctypes
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

HUGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size
MADV_COLLAPSE = 25  # linux/mman.h, since 6.1
MIN_RESIDENT = 0.9  # a mapping is collapsed only when this much of it is in memory
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class Collapsed:
    """What collapse() did: MiB it asked to collapse and MiB that failed, the
    process's MiB on huge pages after it, and why it did nothing, if it did not."""

    asked_mb: int = 0
    failed_mb: int = 0
    huge_mb: int = 0
    skipped: str = ""


def thp_mode() -> str:
    """The kernel's THP setting ('always', 'madvise' or 'never'); '' when it has none."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else text.strip()


def wanted(mode: str, device: str) -> bool:
    """Whether --huge-pages `mode` collapses a model on `device`: auto means on
    for a CPU model on Linux (a GPU model's weights are not in host memory)."""
    if mode not in MODES:
        raise ValueError(f"huge pages must be one of {MODES}, got {mode!r}")
    if mode == "off":
        return False
    return mode == "on" or (device == "cpu" and sys.platform.startswith("linux"))


def huge_mb() -> int:
    """MiB of this process's anonymous memory on huge pages."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) >> 10
    except OSError:
        pass
    return 0


def _mappings() -> list[tuple[int, int]]:
    """(start, length) of this process's anonymous read-write mappings that are
    at least 2 MiB, at least MIN_RESIDENT resident and not already on huge pages."""
    found, current = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header
            perms, inode, path = fields[1], fields[4], fields[5] if len(fields) > 5 else ""
            start, end = (int(x, 16) for x in fields[0].split("-"))
            anonymous = inode == "0" and path in ("", "[heap]")
            current = {"start": start, "size": end - start} if anonymous and perms.startswith("rw") else None
            if current is not None:
                found.append(current)
        elif current is not None and fields and fields[0] in ("Rss:", "AnonHugePages:"):
            current[fields[0]] = int(fields[1]) << 10
    return [(m["start"], m["size"]) for m in found
            if m["size"] >= HUGE and m.get("Rss:", 0) >= MIN_RESIDENT * m["size"]
            and m.get("AnonHugePages:", 0) < m.get("Rss:", 0) - HUGE]


def collapse() -> Collapsed:
    """Collapses this process's resident anonymous memory onto huge pages
    (see the module); never raises. Call it once the model is in memory."""
    if not sys.platform.startswith("linux"):
        return Collapsed(skipped="not Linux")
    if thp_mode() in ("", "never"):
        return Collapsed(skipped=f"transparent huge pages are {thp_mode() or 'not available'} here")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    asked = failed = 0
    errors = set()
    for start, size in _mappings():
        low = -(-start // HUGE) * HUGE
        high = (start + size) // HUGE * HUGE
        if high <= low:
            continue
        asked += high - low
        if libc.madvise(low, high - low, MADV_COLLAPSE) != 0:
            errno = ctypes.get_errno()
            errors.add(errno)
            failed += high - low
            if errno == 22 and asked == high - low:  # EINVAL on the first: a kernel without MADV_COLLAPSE
                return Collapsed(skipped="this kernel has no MADV_COLLAPSE (Linux 6.1 and later)")
    if errors:
        log.info("huge pages: %d MiB of %d MiB not collapsed (errno %s)", failed >> 20, asked >> 20,
                 ", ".join(map(str, sorted(errors))))
    return Collapsed(asked_mb=asked >> 20, failed_mb=failed >> 20, huge_mb=huge_mb())


def apply(mode: str, device: str, what: str = "the model") -> Collapsed:
    """collapse() if `mode` wants it for `device`, logged."""
    if not wanted(mode, device):
        return Collapsed(skipped=f"--huge-pages {mode} on {device}")
    start = time.perf_counter()
    result = collapse()
    if result.skipped:
        log.info("huge pages: not used (%s)", result.skipped)
    else:
        log.info("huge pages: %s and the rest of this process's resident memory: %d MiB on huge pages (%.1f s)",
                 what, result.huge_mb, time.perf_counter() - start)
    return result
