"""A CPU model's weights on transparent huge pages (Linux; --huge-pages).

A decode step on a CPU streams every weight of the model through the caches,
and with 4 KiB pages it also walks a page table for every 4 KiB of them: a
3 GB target is 750,000 pages a token, each a TLB miss, and in a VM each miss is
a two-level walk (the guest's table, then the host's). With 2 MiB pages the
walks are 512 times fewer. MEASURED

torch's CPU allocator does it when THP_MEM_ALLOC_ENABLE is set: each
allocation of 2 MiB or more is aligned to 2 MiB and marked
madvise(MADV_HUGEPAGE), so the kernel backs it with huge pages as it is first
touched (THP "madvise" or "always"). torch reads the variable once, at its
first allocation, so a process's entry point sets it before torch loads
(tandem.cli for the model services, bench/__init__.py and tandem.demo for the
target alone they time). The weights a model service packs or quantizes at
load are new torch allocations, so they land on huge pages. Only the memory
placement changes, never a value, so no output does.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "THP_MEM_ALLOC_ENABLE"  # read by torch's CPU allocator (c10/core/alloc_cpu.cpp)
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MODES = ("auto", "on", "off")


def thp_mode() -> str:
    """The kernel's THP setting ('always', 'madvise' or 'never'); '' when it has none."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else text.strip()


def wanted(mode: str, device: str) -> bool:
    """Whether --huge-pages `mode` wants huge pages for a model on `device`:
    auto means on for a CPU model on Linux (a GPU model's weights are not in
    host memory)."""
    if mode not in MODES:
        raise ValueError(f"huge pages must be one of {MODES}, got {mode!r}")
    if mode == "off":
        return False
    return mode == "on" or (device == "cpu" and sys.platform.startswith("linux"))


def allocate_on_huge_pages(mode: str, device: str) -> bool:
    """In a process's entry point, before torch's first allocation: sets
    whether torch puts its allocations of 2 MiB or more on huge pages, as
    `mode` wants for a model on `device` and the kernel allows; the flag wins
    over a value inherited from the environment. Returns whether it does."""
    on = wanted(mode, device) and thp_mode() in ("madvise", "always")
    os.environ[ENV] = "1" if on else "0"
    return on


def huge_mb() -> int:
    """MiB of this process's anonymous memory on huge pages."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) >> 10
    except OSError:
        pass
    return 0


def report(mode: str, device: str, what: str) -> int:
    """Logs how much of this process is on huge pages once `what` is loaded; returns the MiB."""
    mb = huge_mb()
    if os.environ.get(ENV) == "1":
        log.info("huge pages: %d MiB of this process, %s included, on 2 MiB pages", mb, what)
    else:
        log.info("huge pages: off (--huge-pages %s on %s, THP %s)", mode, device, thp_mode() or "not available")
    return mb
