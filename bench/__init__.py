"""Tandem's benchmarks (make bench, make bench-nodes)."""
import os
import sys

from tandem import hugepages


def _flag(argv: list[str], name: str, default: str) -> str:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return default


# The target alone and HF assisted run in the benchmark's own process, and are
# timed on weights placed as a model service places them (--huge-pages,
# tandem.hugepages). torch reads the setting at its first allocation, before
# any benchmark parses its flags, so the flag is read here.
if "torch" not in sys.modules and hugepages.ENV not in os.environ:
    hugepages.allocate_on_huge_pages(_flag(sys.argv, "--huge-pages", "auto"), _flag(sys.argv, "--device", "cpu"))
