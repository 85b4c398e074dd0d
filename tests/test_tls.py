"""TLS on the public endpoints: `tandem serve orchestrator --tls-cert
--tls-key` serves its gRPC API and its HTTP API over TLS (and with
--tls-client-ca asks clients for certificates), as a process, against the
tiny pair's services; a client that does not speak it, or has no certificate
where one is asked for, gets nothing. Certificates from a throw-away CA
(trustme)."""
import json
import select
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest
import trustme

from tandem.client import TandemClient
from tandem.tls import channel_credentials
from tests.conftest import REDIS_URL, Cluster


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, the server's certificate for 127.0.0.1, and a client's."""
    root = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("client@tandem.test")
    files = {"ca": root / "ca.pem", "cert": root / "server.pem", "key": root / "server.key",
             "client_cert": root / "client.pem", "client_key": root / "client.key"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    server.cert_chain_pems[0].write_to_path(str(files["cert"]))
    server.private_key_pem.write_to_path(str(files["key"]))
    client.cert_chain_pems[0].write_to_path(str(files["client_cert"]))
    client.private_key_pem.write_to_path(str(files["client_key"]))
    named = ca.issue_cert("tandem-services.internal")  # a name, not the address the services are dialled at
    files["named_cert"], files["named_key"] = root / "named.pem", root / "named.key"
    named.cert_chain_pems[0].write_to_path(str(files["named_cert"]))
    named.private_key_pem.write_to_path(str(files["named_key"]))
    other = trustme.CA().issue_cert("client@elsewhere.test")  # a certificate from a CA the server does not trust
    files["stranger_cert"], files["stranger_key"] = root / "stranger.pem", root / "stranger.key"
    other.cert_chain_pems[0].write_to_path(str(files["stranger_cert"]))
    other.private_key_pem.write_to_path(str(files["stranger_key"]))
    return {k: str(v) for k, v in files.items()}


@pytest.fixture(scope="module")
def cluster(char_models):
    cluster = Cluster(char_models["target"], char_models["draft"])
    yield cluster
    cluster.stop()


def _serve(cluster, *flags):
    process = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", "orchestrator", "--port", "0", "--draft", cluster.draft_address,
         "--target", cluster.target_address, "--redis-url", REDIS_URL, "--wait", "60", "--http-port", "0",
         "--served-model-name", "tiny", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert select.select([process.stdout], [], [], 120)[0], "the orchestrator did not start in 120 s"
    http = process.stdout.readline()
    assert http.startswith("HTTP "), process.stderr.read()
    ready = process.stdout.readline()
    assert ready.startswith("READY orchestrator"), process.stderr.read()
    return process, ready.split()[-1], http.split()[-1]


def _stop(process) -> None:
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0 and "Traceback" not in stderr, stderr


def _chat(address: str, context: ssl.SSLContext | None, scheme: str = "https") -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 12,
            "temperature": 0, "return_token_ids": True}
    request = urllib.request.Request(f"{scheme}://{address}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120, context=context) as reply:
        return json.load(reply)["choices"][0]


def test_both_apis_serve_over_tls_and_nothing_in_plaintext(cluster, pki):
    process, address, http = _serve(cluster, "--tls-cert", pki["cert"], "--tls-key", pki["key"])
    try:
        params = dict(max_tokens=16, temperature=0.0)
        with TandemClient(address, timeout_s=120, tls=channel_credentials(pki["ca"])) as client, \
                cluster.client() as reference:
            got = client.generate("Write a haiku about the sea.", **params)
            expected = reference.generate("Write a haiku about the sea.", **params)
            chat_expected = reference.generate(messages=[{"role": "user", "content": "hello"}], max_tokens=12)
        assert got.token_ids == expected.token_ids and len(got.token_ids) == 16
        # The HTTP API, over TLS too (its gateway reaches the orchestrator over its Unix socket).
        answer = _chat(http, ssl.create_default_context(cafile=pki["ca"]))
        assert answer["token_ids"] == chat_expected.token_ids
        with urllib.request.urlopen(f"https://{http}/health", timeout=30,
                                    context=ssl.create_default_context(cafile=pki["ca"])) as reply:
            assert reply.status == 200 and json.load(reply)["status"] == "ok"  # the probe of components/tls
        # Plaintext clients get nothing; nor does a client that does not trust the CA.
        with TandemClient(address, timeout_s=10) as plain:
            with pytest.raises(grpc.RpcError) as refused:
                plain.generate("hi", max_tokens=2)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        with TandemClient(address, timeout_s=10, tls=channel_credentials()) as untrusting:  # the system's roots
            with pytest.raises(grpc.RpcError) as refused:
                untrusting.generate("hi", max_tokens=2)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # the server hangs up
            _chat(http, None, "http")
        with pytest.raises(urllib.error.URLError) as unverified:
            _chat(http, ssl.create_default_context())
        assert "CERTIFICATE_VERIFY_FAILED" in str(unverified.value)
        # The CLI client dials it with --tls-ca.
        printed = subprocess.run(
            [sys.executable, "-m", "tandem.cli", "generate", "Write a haiku about the sea.", "--address", address,
             "--tls-ca", pki["ca"], "--max-tokens", "16", "--temperature", "0", "--json"],
            capture_output=True, text=True, timeout=120)
        assert printed.returncode == 0, printed.stderr
        assert json.loads(printed.stdout)["token_ids"] == expected.token_ids
    finally:
        _stop(process)


def test_a_client_ca_asks_every_client_for_a_certificate_it_signed(cluster, pki):
    process, address, http = _serve(cluster, "--tls-cert", pki["cert"], "--tls-key", pki["key"],
                                    "--tls-client-ca", pki["ca"])
    try:
        with TandemClient(address, timeout_s=120,
                          tls=channel_credentials(pki["ca"], pki["client_cert"], pki["client_key"])) as client:
            assert len(client.generate("hi", max_tokens=4, temperature=0.0).token_ids) == 4
        for cert, key in ((None, None), (pki["stranger_cert"], pki["stranger_key"])):
            credentials = channel_credentials(pki["ca"], cert or "", key or "")
            with TandemClient(address, timeout_s=10, tls=credentials) as client:
                with pytest.raises(grpc.RpcError) as refused:
                    client.generate("hi", max_tokens=2)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        context = ssl.create_default_context(cafile=pki["ca"])
        context.load_cert_chain(pki["client_cert"], pki["client_key"])
        assert len(_chat(http, context)["token_ids"]) == 12
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            _chat(http, ssl.create_default_context(cafile=pki["ca"]))  # no certificate: the handshake fails
    finally:
        _stop(process)


@pytest.mark.parametrize("flags,words", [
    (["--tls-cert", "CERT"], "--tls-cert and --tls-key go together"),
    (["--tls-client-ca", "CA"], "--tls-client-ca needs --tls-cert"),
    (["--tls-cert", "CERT", "--tls-key", "STRANGER_KEY"], "cannot be used"),
    (["--tls-cert", "/nonexistent.pem", "--tls-key", "KEY"], "cannot be read"),
    (["--tls-cert", "CA_AS_TEXT", "--tls-key", "KEY"], "is not PEM"),
])
def test_tls_flags_that_cannot_serve_are_refused_at_start_with_words(pki, tmp_path, flags, words):
    text = tmp_path / "not-a-cert.txt"
    text.write_text("hello")
    files = {"CERT": pki["cert"], "KEY": pki["key"], "CA": pki["ca"], "STRANGER_KEY": pki["stranger_key"],
             "CA_AS_TEXT": str(text)}
    done = subprocess.run([sys.executable, "-m", "tandem.cli", "serve", "orchestrator", "--port", "0",
                           *[files.get(f, f) for f in flags]], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and words in done.stderr, done.stderr


# --- the hops to the model services -----------------------------------------------------------

PROMPT = [5, 17, 33, 60, 12, 9]


def test_the_model_services_over_mutual_tls_lose_nothing(char_models, pki):
    """Services run with --tls-cert and --tls-client-ca; the orchestrator dials
    them with --service-tls-ca and its client certificate: greedy equals the
    target alone. Their certificates may hold a name other than the address
    dialled (--service-tls-server-name)."""
    from tandem.tls import ServerTls
    from tests.conftest import reference_greedy

    expected = reference_greedy(char_models["target"], PROMPT, 16)
    for cert, key, name in ((pki["cert"], pki["key"], ""),
                            (pki["named_cert"], pki["named_key"], "tandem-services.internal")):
        cluster = Cluster(char_models["target"], char_models["draft"], relay=False, service_tls={
            "server": ServerTls(cert, key, pki["ca"]), "ca": pki["ca"], "cert": pki["client_cert"],
            "key": pki["client_key"], "server_name": name})
        try:
            with cluster.client() as client:
                result = client.generate(prompt_ids=PROMPT, max_tokens=16, num_draft_tokens=3)
            assert result.token_ids == expected and result.stats.drafted_tokens > 0  # the draft answered too
            # The orchestrator's process with the same settings starts; one that does
            # not speak TLS to them, or has no client certificate, or one of another
            # CA, is not let in: it does not start.
            named = ["--service-tls-server-name", name] if name else []
            ours = ["--service-tls-ca", pki["ca"], "--service-tls-cert", pki["client_cert"], "--service-tls-key",
                    pki["client_key"], *named]
            for flags, starts in ((ours, True), ([], False), (["--service-tls-ca", pki["ca"], *named], False),
                                  (["--service-tls-ca", pki["ca"], "--service-tls-cert", pki["stranger_cert"],
                                    "--service-tls-key", pki["stranger_key"], *named], False)):
                process = subprocess.Popen(
                    [sys.executable, "-m", "tandem.cli", "serve", "orchestrator", "--port", "0", "--draft",
                     cluster.draft_address, "--target", cluster.target_address, "--redis-url", REDIS_URL,
                     "--tokenizer", char_models["draft"], "--wait", "3", "--draft-fallback", "off", *flags],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                ready = process.stdout.readline()
                process.send_signal(signal.SIGTERM)
                _, stderr = process.communicate(timeout=60)
                assert ready.startswith("READY") == starts, (flags, stderr)
                assert process.returncode == (0 if starts else 2), (flags, stderr)
        finally:
            cluster.stop()


def test_service_tls_settings_that_cannot_work_are_refused():
    from orchestrator.config import OrchestratorConfig

    for settings, words in (({"service_tls_cert": "c.pem", "service_tls_key": "k.pem"}, "need --service-tls-ca"),
                            ({"service_tls_ca": "ca.pem", "service_tls_cert": "c.pem"}, "go together"),
                            ({"service_tls_ca": "ca.pem", "relay": True}, "--relay on")):
        with pytest.raises(ValueError, match=words):
            OrchestratorConfig("d:1", "t:1", **settings)
