"""The orchestrator as its own process (`tandem serve orchestrator`), as a
deployment runs it: it loads no torch, and it serves text as the in-process
orchestrator of the tests' clusters does, over gRPC and over its HTTP API."""
import json
import select
import signal
import subprocess
import sys
import urllib.request

import pytest

from tandem.client import TandemClient
from tests.conftest import REDIS_URL, Cluster


def test_the_orchestrator_process_serves_text_without_torch(char_models):
    cluster = Cluster(char_models["target"], char_models["draft"])
    process = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", "orchestrator", "--port", "0", "--draft",
         cluster.draft_address, "--target", cluster.target_address, "--redis-url", REDIS_URL, "--wait", "60",
         "--http-port", "0", "--served-model-name", "tiny"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert select.select([process.stdout], [], [], 120)[0], "the orchestrator did not start in 120 s"
        http = process.stdout.readline()
        assert http.startswith("HTTP "), process.stderr.read()
        ready = process.stdout.readline()
        assert ready.startswith("READY orchestrator"), process.stderr.read()
        with open(f"/proc/{process.pid}/maps") as maps:
            mapped = maps.read()
        assert "libtorch" not in mapped, "the orchestrator's process loaded torch"
        params = dict(max_tokens=24, temperature=0.0)
        with TandemClient(ready.split()[-1], timeout_s=120) as client, cluster.client() as reference:
            got = client.generate("Write a haiku about the sea.", **params)
            expected = reference.generate("Write a haiku about the sea.", **params)
            session = client.create_session(system_prompt="Answer briefly.")
            chat = [client.chat(session, message, **params) for message in ("hello", "and again")]
            session = reference.create_session(system_prompt="Answer briefly.")
            chat_expected = [reference.chat(session, message, **params) for message in ("hello", "and again")]
        body = {"model": "tiny", "messages": [{"role": "system", "content": "Answer briefly."},
                                              {"role": "user", "content": "hello"}],
                "return_token_ids": True, **params}
        request = urllib.request.Request(f"http://{http.split()[-1]}/v1/chat/completions",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            over_http = json.load(reply)["choices"][0]
        assert over_http["token_ids"] == chat_expected[0].token_ids
        assert over_http["message"]["content"] == chat_expected[0].text
        # Log probabilities pass through the process untouched, and through the CLI.
        with TandemClient(ready.split()[-1], timeout_s=120) as client, cluster.client() as reference:
            scored = client.generate("Write a haiku", logprobs=True, top_logprobs=2, **params)
            scored_expected = reference.generate("Write a haiku", logprobs=True, top_logprobs=2, **params)
        assert [(lp.token_id, lp.token) for lp in scored.logprobs] == \
               [(t, chr(t)) for t in scored_expected.token_ids]
        # (to rounding: one request's prompt may run in another forward than the other's)
        assert [lp.logprob for lp in scored.logprobs] == \
               pytest.approx([lp.logprob for lp in scored_expected.logprobs], abs=1e-4)
        printed = subprocess.run(
            [sys.executable, "-m", "tandem.cli", "generate", "Write a haiku", "--address", ready.split()[-1],
             "--max-tokens", "24", "--temperature", "0", "--logprobs", "2", "--prompt-logprobs", "1", "--json"],
            capture_output=True, text=True, timeout=120, check=True)
        printed = json.loads(printed.stdout)
        prompt = printed["prompt"]
        with cluster.client() as reference:
            ids = list(reference.tokenize("Write a haiku").token_ids)
        assert prompt["token_ids"] == ids and prompt["first_token"] == chr(ids[0])
        assert [lp["token"] for lp in prompt["logprobs"]] == [chr(t) for t in ids[1:]]
        printed = printed["logprobs"]
        assert [lp["token_id"] for lp in printed] == scored_expected.token_ids
        assert [lp["logprob"] for lp in printed] == \
               pytest.approx([lp.logprob for lp in scored_expected.logprobs], abs=1e-4)
        assert all(len(lp["top_logprobs"]) == 2 for lp in printed)
        with open(f"/proc/{process.pid}/maps") as maps:
            assert "libtorch" not in maps.read(), "the orchestrator's process loaded torch"
        assert got.token_ids == expected.token_ids and got.text == expected.text and len(got.token_ids) == 24
        assert [r.token_ids for r in chat] == [r.token_ids for r in chat_expected]
        assert [r.text for r in chat] == [r.text for r in chat_expected]
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        cluster.stop()
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr and "PyTorch was not found" not in stderr


def test_a_process_that_keeps_torch_out_builds_a_default_model_in_a_child(tmp_path, monkeypatch):
    """The orchestrator's --tokenizer default-draft on a fresh machine: the build
    (which dequantizes with torch) runs as `python -m tandem.default_models` in a
    child process; a child that fails is reported with the command to rerun.
    The child is faked here: a real build takes a minute."""
    import subprocess as real_subprocess

    from tandem import default_models

    monkeypatch.setenv("TANDEM_MODEL_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "torch", None)
    commands = []

    def child(command, stdout=None):
        commands.append(command)
        if len(commands) == 1:  # the first build fails
            return real_subprocess.CompletedProcess(command, 1)
        out = tmp_path / default_models.DEFAULT_DRAFT.name
        out.mkdir()
        spec = default_models.DEFAULT_DRAFT
        (out / default_models.MARKER).write_text(json.dumps({"sha256": spec.sha256, "name": spec.name}))
        return real_subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(default_models.subprocess, "run", child)
    with pytest.raises(default_models.FetchError, match="run python -m tandem.default_models --which draft"):
        default_models.resolve_model("default-draft", progress=False)
    path = default_models.resolve_model("default-draft", progress=False)
    assert path == str(tmp_path / default_models.DEFAULT_DRAFT.name)
    assert commands == [[sys.executable, "-m", "tandem.default_models", "--which", "draft", "--quiet"]] * 2
    assert default_models.resolve_model("default-draft") == path and len(commands) == 2  # built: no child
