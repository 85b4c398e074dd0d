"""Where a model service computes, and whether two of them share cores.

A service reports its placement in ModelInfo (host_id, cpus, threads). The
orchestrator's `--prefill-overlap auto` reads both: a turn's first round
runs the two services' prefills at once, which pays where each has cores of
its own (two nodes, two GPUs, or pinned cores as in `make bench-nodes`) and
costs where their threads outnumber the cores they share. On a 2-core Zen 4
VM with both services unpinned at two torch threads each (a sequential
deployment), the median time to first token was 1475 ms over 12 prompts with
the overlap on and 831 ms over 16 with it off (bench.overlap_probe,
bench/RESULTS.md): four threads on two cores slow both prefills more than
running them one after the other does."""

from __future__ import annotations

import os

BOOT_ID = "/proc/sys/kernel/random/boot_id"


def host_id() -> str:
    """The running kernel's boot id: the same for every process and container
    on one machine, different on another (or after a reboot); "" where the
    kernel does not expose it."""
    try:
        with open(BOOT_ID, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def cpus() -> list[int]:
    """The CPUs this process may run on ([] where the platform cannot say)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []


def shared_cores(draft, target) -> str | None:
    """Why the two services' prefills should not run at once, or None.

    `draft` and `target` are ModelInfo messages. They contend when both run on
    a CPU of the same machine and their torch threads outnumber the CPUs the
    two may run on between them. Anything unknown (an older service, no boot
    id, a GPU, the model-free n-gram drafter, whose prefill costs nothing)
    counts as not contending: overlap is the default."""
    if draft.backend == "ngram":
        return None
    if not (draft.device.startswith("cpu") and target.device.startswith("cpu")):
        return None
    if not draft.host_id or draft.host_id != target.host_id or not draft.cpus or not target.cpus:
        return None
    union = set(draft.cpus) | set(target.cpus)
    threads = draft.threads + target.threads
    if not draft.threads or not target.threads or threads <= len(union):
        return None
    return (f"the draft ({draft.threads} threads on CPUs {_span(draft.cpus)}) and the target "
            f"({target.threads} threads on CPUs {_span(target.cpus)}) share a machine's {len(union)} CPUs")


def _span(ids) -> str:
    ids = sorted(ids)
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 2 and ids[-1] - ids[0] == len(ids) - 1 else ",".join(map(str, ids))
