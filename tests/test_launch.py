"""Services started by tandem.launch end with the process that launched them,
however it dies (a benchmark killed by the OOM killer left three behind)."""
import os
import signal
import subprocess
import sys
import time

import pytest

LAUNCHER = """
import sys, time
from pathlib import Path
from tandem.launch import Service
service = Service("draft", ["--model", sys.argv[1], "--backend", "ngram", "--dtype", "float32"])
service.start(Path(sys.argv[2]))
service.wait_ready(120)
print(service.process.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:  # a zombie has exited; only its parent (init) has yet to reap it
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:  # reaped in between
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_launched_service_ends_when_its_launcher_is_killed(tiny_models, tmp_path):
    service_pid = None
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, tiny_models["target"], str(tmp_path)],
                                stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        service_pid = int(launcher.stdout.readline())
        assert alive(service_pid)
        launcher.send_signal(signal.SIGKILL)  # no cleanup runs in the launcher
        launcher.wait(10)
        deadline = time.monotonic() + 30
        while alive(service_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(service_pid), "the service outlived its launcher"
    finally:
        launcher.kill()
        if service_pid is not None and alive(service_pid):
            os.kill(service_pid, signal.SIGKILL)
