"""--huge-pages (tandem.hugepages): a model service has torch put its large
allocations, the weights among them, on transparent huge pages. Checked in a
fresh process each time (torch reads the setting at its first allocation):
with it on, a large tensor's memory is on 2 MiB pages and holds what was
written; with it off, it is not."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tandem import hugepages

# In a fresh interpreter: the setting, then torch, then a 64 MiB tensor; prints
# what its mapping holds on huge pages and whether its values survived.
PROBE = """
import json, sys
from tandem import hugepages
on = hugepages.allocate_on_huge_pages(sys.argv[1], "cpu")
import torch
x = torch.arange(16 << 20, dtype=torch.float32)  # 64 MiB
address, huge, inside = x.data_ptr(), 0, False
for line in open("/proc/self/smaps"):
    fields = line.split()
    if fields and "-" in fields[0] and not fields[0].endswith(":"):
        start, end = (int(v, 16) for v in fields[0].split("-"))
        inside = start <= address < end
    elif inside and fields[0] == "AnonHugePages:":
        huge = int(fields[1]) << 10
exact = bool((x == torch.arange(16 << 20, dtype=torch.float32)).all())
print(json.dumps({"on": on, "huge_mib": huge >> 20, "exact": exact}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or hugepages.thp_mode() not in ("madvise", "always"),
                    reason="transparent huge pages are not available to madvise on this machine")
def test_a_large_tensor_is_on_huge_pages_only_when_asked():
    on = _probe("on")
    assert on["on"] and on["exact"]
    assert on["huge_mib"] >= 60, on  # 64 MiB, 2 MiB-aligned: all of it, less what the kernel could not back
    off = _probe("off")
    assert not off["on"] and off["exact"]
    if hugepages.thp_mode() == "madvise":  # with "always" the kernel backs everything it can anyway
        assert off["huge_mib"] < 4, off


def test_modes(monkeypatch):
    linux = sys.platform.startswith("linux")
    assert hugepages.wanted("auto", "cpu") is linux
    assert not hugepages.wanted("auto", "cuda:0")  # a GPU model's weights are not in host memory
    assert hugepages.wanted("on", "cuda:0")
    assert not hugepages.wanted("off", "cpu")
    with pytest.raises(ValueError, match="huge pages"):
        hugepages.wanted("always", "cpu")
    monkeypatch.setenv(hugepages.ENV, "1")
    assert not hugepages.allocate_on_huge_pages("off", "cpu")
    assert os.environ[hugepages.ENV] == "0"  # the flag wins over an inherited setting
