"""C kernels compiled once per machine and loaded with ctypes (tandem/bf16w.c,
tandem/i4w.c).

A source is compiled with the system's C compiler (`cc`, or $CC) into
$TANDEM_KERNEL_CACHE (default ~/.cache/tandem/kernels), under a name that hashes
the source and the flags, the first time a process asks for it (about half a
second); ctypes releases the GIL for each call. Where the CPU or the machine
cannot run it, `unavailable()` says why and callers keep their torch kernels."""
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
from typing import Callable

import torch

log = logging.getLogger(__name__)

COMMON_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]


def cpu_capability() -> str | None:
    """"AVX512" or "AVX2", what torch's dispatcher found; None otherwise."""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return None
    return capability if capability in ("AVX512", "AVX2") else None


def cpu_features() -> dict:
    """The CPU's features as torch's cpuinfo reports them ({"avx512_vnni": True, ...}); empty where it cannot."""
    try:
        return torch.cpu.get_capabilities()
    except (AttributeError, RuntimeError):
        return {}


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_KERNEL_CACHE") or Path.home() / ".cache" / "tandem" / "kernels")


class CKernel:
    """One C source. `flags()` gives the compiler flags for this CPU, or raises
    RuntimeError saying why it has no build; `declare(lib)` sets the exported
    functions' argtypes and may raise RuntimeError after checking the CPU."""

    def __init__(self, name: str, source: Path, flags: Callable[[], list[str]], declare: Callable[[ctypes.CDLL], None]):
        self.name, self.source, self._flags, self._declare = name, source, flags, declare
        self._lock = threading.Lock()
        self._library: ctypes.CDLL | None = None
        self._failure: str | None = None

    def library(self) -> ctypes.CDLL | None:
        """The compiled kernel, built on first use; None (and why in
        unavailable()) where the CPU or the machine cannot run it."""
        if self._library is not None:  # every layer call asks: no lock once loaded
            return self._library
        with self._lock:
            if self._library is not None or self._failure is not None:
                return self._library
            try:
                self._library = self._build_and_load()
            except (OSError, subprocess.CalledProcessError, RuntimeError) as err:
                self._failure = str(err)
                log.info("%s kernel unavailable: %s", self.name, self._failure)
            return self._library

    def unavailable(self) -> str | None:
        """Why the kernel cannot run here, or None."""
        self.library()
        return self._failure

    def _build_and_load(self) -> ctypes.CDLL:
        flags = [*COMMON_FLAGS, *self._flags()]
        cc = compiler()
        if cc is None:
            raise RuntimeError("no C compiler (cc, gcc or $CC) to build it with")
        source = self.source.read_bytes()
        key = hashlib.sha256(source + " ".join([cc, *flags]).encode()).hexdigest()[:16]
        target = cache_dir() / f"{self.name}-{key}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                result = subprocess.run([cc, *flags, str(self.source), "-o", str(built)], capture_output=True, text=True)
                if result.returncode:
                    raise RuntimeError(f"{cc} failed to build {self.source.name}: {result.stderr.strip()[-500:]}")
                os.replace(built, target)  # atomic: another process may build it at the same time
            log.info("built the %s kernel: %s", self.name, target)
        lib = ctypes.CDLL(str(target))
        self._declare(lib)
        return lib
