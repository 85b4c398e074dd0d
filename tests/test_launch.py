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


def test_a_service_whose_port_was_taken_starts_again_on_another(tiny_models, tmp_path):
    """free_port's port is free only when picked: another process may bind it
    before the service does (a flake seen when two test workers launched
    services at once). The service then starts again on a fresh port."""
    import socket

    import grpc

    from tandem.launch import Service
    from tandem.v1 import common_pb2, draft_pb2_grpc

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    service = Service("draft", ["--model", tiny_models["target"], "--backend", "ngram", "--dtype", "float32"],
                      port=taken)
    try:
        service.start(tmp_path)
        service.ready(tmp_path, 120)
        assert service.port != taken and service.process.poll() is None
        with grpc.insecure_channel(service.address) as channel:
            info = draft_pb2_grpc.DraftServiceStub(channel).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=30)
        assert info.backend == "ngram"
    finally:
        service.stop()
        holder.close()
