"""The argparse types and limits of the `tandem` command line's flags, shared by
tandem/cli_flags.py (the client commands) and tandem/serve_flags.py (the services)."""
from __future__ import annotations

import argparse


def ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def int_in(low: int, high: int):
    """An argparse type: an integer in [low, high]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}")
        return value
    return parse


def auto_or(parse):
    """An argparse type: "auto" (None), or what `parse` takes."""
    return lambda text: None if text == "auto" else parse(text)


INT32_MAX, UINT64_MAX = 2**31 - 1, 2**64 - 1
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def bias(text: str) -> tuple[int, float]:
    """--logit-bias ID=BIAS."""
    token, _, bias = text.partition("=")
    try:
        pair = int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS, such as 151643=-100, got {text!r}") from None
    if pair[0] < 0 or not -100 <= pair[1] <= 100:
        raise argparse.ArgumentTypeError(f"a token id >= 0 and a bias in [-100, 100], got {text!r}")
    return pair


def tenant_priority(text: str) -> tuple[str, int]:
    """--tenant-priority TENANT=N."""
    tenant, _, priority = text.rpartition("=")
    try:
        pair = tenant, int(priority)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TENANT=PRIORITY, such as premium=-1, got {text!r}") from None
    if not tenant or not -INT32_MAX - 1 <= pair[1] <= INT32_MAX:
        raise argparse.ArgumentTypeError(f"a tenant and a 32-bit priority, got {text!r}")
    return pair
