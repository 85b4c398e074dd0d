"""Starts Tandem's three services as separate processes (demo, benchmarks),
optionally pinned to CPU cores, and stops them with SIGTERM."""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


PARENT_ENV = "TANDEM_PARENT_PID"  # set by Service.start: the service ends when that process does
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
PORT_TAKEN = "Address already in use"  # gRPC's words in a service's log when its port was bound first


def die_with_parent() -> None:
    """In a service started by Service.start: have the kernel send this process
    SIGTERM (a graceful drain) when the launching process dies, however it
    dies. Without it a benchmark or demo killed with SIGKILL, or by the OOM
    killer, left its three services running, holding their models' memory.
    Set here rather than in a preexec_fn, which is unsafe in a process with
    threads (gRPC's). Linux only; elsewhere, and without the variable, a no-op."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return
    if os.getppid() != int(parent):  # the launcher died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Service:
    role: str
    args: list[str]
    cpus: str | None = None  # taskset list, e.g. "0" or "0,1"
    threads: int | None = None
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, log_dir: Path) -> None:
        cmd = [sys.executable, "-m", "tandem.cli", "serve", self.role, "--port", str(self.port), *self.args]
        if self.threads:
            cmd += ["--threads", str(self.threads)] if self.role != "orchestrator" else []
        if self.cpus is not None and shutil.which("taskset"):
            cmd = ["taskset", "-c", self.cpus, *cmd]
        env = {**os.environ, PARENT_ENV: str(os.getpid())}  # taskset execs the service: same pid, same parent
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        self.log_path = log_dir / f"{self.role}-{self.port}.log"
        log.info("starting %s: %s", self.role, " ".join(cmd))
        self.process = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=open(self.log_path, "w"), text=True, env=env
        )

    def wait_ready(self, timeout_s: float) -> None:
        ready = threading.Event()

        def read():
            for line in self.process.stdout:
                if line.startswith("READY"):
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not ready.wait(0.2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text()[-3000:] if self.log_path else ""
                raise RuntimeError(f"{self.role} did not start (see {self.log_path}):\n{tail}")

    def ready(self, log_dir: Path, timeout_s: float, attempts: int = 3) -> None:
        """wait_ready; a service that found its port taken (free_port's port is
        only free when picked: a process launched beside this one, a test of
        another worker, may bind it first) starts again on a fresh port."""
        for attempt in range(1, attempts + 1):
            try:
                return self.wait_ready(timeout_s)
            except RuntimeError:
                if attempt == attempts or not self._port_taken():
                    raise
            log.warning("%s: port %d was taken before it bound it; starting it again", self.role, self.port)
            self.port = free_port()
            self.start(log_dir)

    def _port_taken(self) -> bool:
        return (self.process.poll() is not None and self.log_path is not None
                and PORT_TAKEN in self.log_path.read_text(errors="replace"))

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()


class Deployment:
    """target + draft + orchestrator processes on this machine."""

    def __init__(self, target: Service, draft: Service, orchestrator_args: list[str],
                 orchestrator_cpus: str | None = None, log_dir: str | Path | None = None):
        self.log_dir = Path(log_dir or Path.home() / ".cache" / "tandem" / "logs")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.target, self.draft = target, draft
        # Given the model services' addresses once they serve (a port taken meanwhile moves one).
        self.orchestrator = Service("orchestrator", list(orchestrator_args), cpus=orchestrator_cpus)

    @property
    def address(self) -> str:
        return self.orchestrator.address

    def __enter__(self):
        try:
            self.target.start(self.log_dir)
            self.draft.start(self.log_dir)
            self.target.ready(self.log_dir, 900)
            self.draft.ready(self.log_dir, 900)
            self.orchestrator.args[:0] = ["--target", self.target.address, "--draft", self.draft.address]
            self.orchestrator.start(self.log_dir)
            self.orchestrator.ready(self.log_dir, 120)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for service in (self.orchestrator, self.draft, self.target):
            service.stop()
