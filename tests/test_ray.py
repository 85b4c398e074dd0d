"""Tandem on a Ray cluster (`tandem ray up | status | down`), on a real local
Ray head with the character-level pair: the services Ray places serve as
they do anywhere (greedy equals the target alone), register their addresses
in Redis for an orchestrator started elsewhere (--discover), come back on
their port when their process dies, and leave nothing behind when taken
down."""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest
import redis

from tandem.client import TandemClient
from tandem.launch import free_port
from tests.conftest import REDIS_URL, reference_greedy

RAY = Path(sys.executable).parent / "ray"
# A throw-away local cluster: no token (Ray's token auth would otherwise hang on
# whatever ~/.ray/auth_token an earlier local ray.init left), on the loopback.
RAY_ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}
PROMPT = [5, 17, 33, 60, 12, 9]


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head of its own (its own temp dir, which its processes' command
    lines name), stopped alone at the end: `ray stop` would stop every Ray
    cluster of this user on the machine."""
    if not RAY.exists():
        pytest.fail("ray is a dependency of Tandem's dev setup; run make setup")
    port, temp_dir = free_port(), tempfile.mkdtemp(prefix="tray-", dir="/tmp")  # short: Ray's socket paths
    started = subprocess.run([str(RAY), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                              "--num-cpus=2", "--include-dashboard=false", f"--temp-dir={temp_dir}",
                              "--disable-usage-stats", "--object-store-memory=100000000"],
                             capture_output=True, text=True, timeout=180, env=RAY_ENV)
    assert started.returncode == 0, started.stderr
    yield f"127.0.0.1:{port}"
    _stop_processes_naming(temp_dir)
    shutil.rmtree(temp_dir, ignore_errors=True)


def _stop_processes_naming(text: str, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, to every process whose command line holds `text`."""
    def matching() -> list[int]:
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if text.encode() in (entry / "cmdline").read_bytes():
                        pids.append(int(entry.name))
                except OSError:
                    continue
        return pids

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in matching():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while matching() and time.monotonic() < deadline:
            time.sleep(0.2)


def _tandem(*argv, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=RAY_ENV)


def _status(ray_head, name) -> tuple[int, dict]:
    done = _tandem("ray", "status", "--address", ray_head, "--name", name, "--redis-url", REDIS_URL, timeout=120)
    return done.returncode, json.loads(done.stdout)


def test_ray_places_the_services_which_serve_as_anywhere_and_come_down_whole(char_models, ray_head):
    name = f"test-{uuid.uuid4().hex[:8]}"
    common = ("--address", ray_head, "--name", name, "--redis-url", REDIS_URL)
    # float32, as the reference: the services' auto is bfloat16 on a CPU with AMX.
    up = _tandem("ray", "up", *common, "--target-model", char_models["target"], "--draft-model", char_models["draft"],
                 "--target-args", "--threads 1 --dtype float32", "--draft-args", "--threads 1 --dtype float32",
                 "--gpus-per-service", "0",
                 "--target-replicas", "2", "--cpus-per-service", "0.5", "--timeout", "300")
    assert up.returncode == 0, up.stderr
    placed = json.loads(up.stdout.strip().splitlines()[-1])
    assert set(placed) >= {"name", "target", "draft", "orchestrator", "http"}
    targets = placed["target"].split(",")  # two replicas of the target (orchestrator.replicas)
    assert len(set(targets)) == 2 and "," not in placed["draft"]
    expected = reference_greedy(char_models["target"], PROMPT, 16)
    outside = None
    try:
        with TandemClient(placed["orchestrator"], timeout_s=120) as client:
            assert client.generate(prompt_ids=PROMPT, max_tokens=16).token_ids == expected
        with urllib.request.urlopen(f"http://{placed['http']}/health", timeout=30) as reply:
            assert json.load(reply)["status"] == "ok"
        registry = redis.Redis.from_url(REDIS_URL).hgetall(f"tandem:ray:{name}")
        assert {k.decode(): v.decode() for k, v in registry.items()} == {
            "target": targets[0], "target-1": targets[1], **{k: placed[k] for k in ("draft", "orchestrator", "http")}}
        again = _tandem("ray", "up", *common, "--gpus-per-service", "0", timeout=120)
        assert again.returncode == 2 and "is up already" in again.stderr  # and the one up is left as it was
        code, status = _status(ray_head, name)
        assert code == 0 and set(status["services"]) == {"target", "target-1", "draft", "orchestrator"}
        assert all(s["alive"] and s["restarts"] == 0 for s in status["services"].values())

        # An orchestrator started elsewhere finds the model services through Redis.
        outside = subprocess.Popen([sys.executable, "-m", "tandem.cli", "serve", "orchestrator", "--port", "0",
                                    "--discover", name, "--redis-url", REDIS_URL, "--tokenizer", char_models["draft"],
                                    "--wait", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready = outside.stdout.readline()
        assert ready.startswith("READY orchestrator"), outside.stderr.read()
        with TandemClient(ready.split()[-1], timeout_s=120) as client:
            assert client.generate(prompt_ids=PROMPT, max_tokens=16).token_ids == expected

        # A target replica's process dies: the other takes its sessions at once, and its
        # actor starts it again on the same port.
        target_pid = status["services"]["target"]["pid"]
        subprocess.run(["kill", "-9", str(target_pid)], check=True)
        with TandemClient(placed["orchestrator"], timeout_s=120) as client:
            for i in range(4):
                assert client.generate(prompt_ids=PROMPT[i:], max_tokens=16).token_ids == reference_greedy(
                    char_models["target"], PROMPT[i:], 16)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            code, status = _status(ray_head, name)
            target = status["services"]["target"]
            if target["alive"] and target["restarts"] == 1:
                break
            time.sleep(1)
        assert target["alive"] and target["restarts"] == 1 and target["pid"] != target_pid, status
        assert target["address"] == targets[0]
        with TandemClient(placed["orchestrator"], timeout_s=120) as client:
            for _ in range(30):  # the orchestrator's channel reconnects within seconds
                try:
                    assert client.generate(prompt_ids=PROMPT, max_tokens=16).token_ids == expected
                    break
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                    time.sleep(1)
            else:
                pytest.fail("the orchestrator did not reach the restarted target in 30 s")
    finally:
        if outside is not None:
            outside.send_signal(signal.SIGTERM)
            outside.communicate(timeout=60)
        down = _tandem("ray", "down", *common, timeout=300)
    assert down.returncode == 0, down.stderr
    assert redis.Redis.from_url(REDIS_URL).exists(f"tandem:ray:{name}") == 0
    assert "target-1" in down.stderr  # every replica stopped
    code, status = _status(ray_head, name)
    assert code == 1 and status["services"] == {}
    with TandemClient(placed["orchestrator"], timeout_s=5) as client:
        with pytest.raises(grpc.RpcError) as gone:
            client.generate(prompt_ids=PROMPT, max_tokens=2)
        assert gone.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert _tandem("ray", "down", *common, timeout=300).returncode == 1  # nothing left to take down


def test_gpus_and_slots_for_replicas():
    from tandem.ray_cluster import _gpus_per_service, discover, joined, slots

    assert [_gpus_per_service("auto", gpus, services) for gpus, services in
            ((0, 2), (1, 2), (2, 2), (2, 3), (4, 3), (1, 3), (3, 4))] == [0.0, 0.5, 1.0, 0.5, 1.0, 1 / 3, 0.5]
    assert _gpus_per_service("0.25", 8, 3) == 0.25
    assert slots("target", 3) == ["target", "target-1", "target-2"] and slots("draft", 1) == ["draft"]
    fields = {"target-10": "k:1", "target": "a:1", "target-2": "c:1", "target-1": "b:1", "draft": "d:1"}
    assert joined(fields, "target") == "a:1,b:1,c:1,k:1" and joined(fields, "draft") == "d:1"
    name = f"test-{uuid.uuid4().hex[:8]}"
    store = redis.Redis.from_url(REDIS_URL)
    store.hset(f"tandem:ray:{name}", mapping={**fields, "orchestrator": "o:1", "http": "h:1"})
    try:
        assert discover(REDIS_URL, name) == {"target": "a:1,b:1,c:1,k:1", "draft": "d:1", "orchestrator": "o:1",
                                             "http": "h:1"}
    finally:
        store.delete(f"tandem:ray:{name}")
