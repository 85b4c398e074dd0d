"""API keys (--api-keys): a call without a valid key is UNAUTHENTICATED, the key
decides the tenant, and one tenant's key reaches no other tenant's session;
over gRPC and over the HTTP API."""
import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from orchestrator.auth import ApiKeys, bearer
from tests.conftest import Cluster, reference_greedy
from tests.test_http_api import _gateway

ALICE, BOB = "alice-key-0123456789abcdef", "bob-key-0123456789abcdef"
PROMPT = [3, 14, 15, 92, 65, 35]


def test_the_keys_file_names_a_tenant_per_key():
    keys = ApiKeys.parse(f"# tenants\n\nalice {ALICE}\n  bob   {BOB}  \n")
    assert len(keys) == 2
    assert keys.tenant_of(ALICE) == "alice" and keys.tenant_of(BOB) == "bob"
    assert keys.tenant_of("alice") is None and keys.tenant_of("") is None


@pytest.mark.parametrize("text, words", [
    ("alice", "line 1: expected 'TENANT KEY', got 1 fields"),
    (f"alice {ALICE}\nbob {ALICE}", "line 2: this key was already given (to tenant 'alice')"),
    ("# nothing\n", "no API keys"),
])
def test_a_bad_keys_file_is_refused_with_its_line(text, words):
    with pytest.raises(ValueError) as caught:
        ApiKeys.parse(text, "keys.txt")
    assert words in str(caught.value)


def test_the_bearer_key_is_read_from_the_metadata():
    assert bearer([("authorization", f"Bearer {ALICE}")]) == ALICE
    assert bearer([("x", "y"), ("authorization", f"bearer  {ALICE} ")]) == ALICE
    assert bearer([("authorization", f"Basic {ALICE}")]) is None
    assert bearer([("authorization", "Bearer ")]) is None and bearer(None) is None


@pytest.fixture(scope="module")
def secured(char_models, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(f"alice {ALICE}\nbob {BOB}\n")
    cluster = Cluster(char_models["target"], char_models["draft"], api_keys_file=str(path))
    base, stop = _gateway(cluster, "tandem-tiny")
    yield cluster, base
    stop()
    cluster.stop()


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code(), caught.value.details()


def test_a_call_without_a_valid_key_is_unauthenticated(secured):
    cluster, _ = secured
    for api_key, words in ((None, "needs an API key"), ("wrong-key", "not valid")):
        with cluster.client(api_key=api_key) as client:
            for call in (lambda: client.generate(prompt_ids=PROMPT, max_tokens=2),
                         lambda: client.create_session(),
                         lambda: client.chat("some-session", message_ids=[1, 2], max_tokens=2),
                         lambda: client.delete_session("some-session")):
                code, details = _code(call)
                assert code == grpc.StatusCode.UNAUTHENTICATED and words in details
            info = client.server_info()  # the model pair's names need no key
            assert info.target_model and info.api_keys_required


def test_the_key_decides_the_tenant(secured, char_models):
    cluster, _ = secured
    with cluster.client(api_key=ALICE) as alice, cluster.client(api_key=BOB) as bob, \
            cluster.client(api_key=ALICE, tenant="alice") as alice_named, \
            cluster.client(api_key=ALICE, tenant="bob") as alice_as_bob:
        result = alice.generate(prompt_ids=PROMPT, max_tokens=6)
        assert result.token_ids == reference_greedy(char_models["target"], PROMPT, 6)
        session = alice.create_session()
        code, details = _code(lambda: bob.chat(session, message_ids=[1, 2], max_tokens=2))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "another tenant" in details
        code, _ = _code(lambda: bob.delete_session(session))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        code, details = _code(lambda: alice_as_bob.generate(prompt_ids=PROMPT, max_tokens=2))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "tenant 'alice'" in details
        assert alice_named.chat(session, message_ids=[1, 2], max_tokens=2).completion_tokens == 2
        assert alice.delete_session(session)


def test_the_http_api_takes_the_key_from_the_authorization_header(secured, char_models):
    cluster, base = secured
    good = openai.OpenAI(base_url=f"{base}/v1", api_key=ALICE, max_retries=0, timeout=60)
    answer = good.completions.create(model="tandem-tiny", prompt="abc", max_tokens=4, temperature=0)
    assert answer.usage.completion_tokens == 4
    bad = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong-key", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as caught:
        bad.completions.create(model="tandem-tiny", prompt="abc", max_tokens=4)
    assert caught.value.status_code == 401 and "not valid" in caught.value.body["message"]
    with urllib.request.urlopen(f"{base}/health", timeout=30) as reply:  # a probe needs no key
        assert reply.status == 200
    # Tokenizing is work on the server: it takes a key too.
    for headers, status in [({}, 401), ({"Authorization": f"Bearer {ALICE}"}, 200)]:
        request = urllib.request.Request(f"{base}/tokenize", data=json.dumps({"prompt": "abc"}).encode(),
                                         headers={"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                assert (reply.status, len(json.load(reply)["tokens"])) == (status, 3)
        except urllib.error.HTTPError as err:
            assert err.code == status, headers


def test_a_stored_response_is_its_keys_tenants(secured):
    """The stored responses' rpcs (the HTTP API's previous_response_id) need a
    key, and the key's tenant alone reaches what it stored."""
    from tandem.v1 import tandem_pb2, tandem_pb2_grpc

    cluster, _ = secured
    ref = tandem_pb2.StoredResponseRef(response_id="resp_alices")
    with grpc.insecure_channel(cluster.address) as channel:
        stub = tandem_pb2_grpc.TandemStub(channel)
        as_alice, as_bob = ((("authorization", f"Bearer {key}"),) for key in (ALICE, BOB))
        put = tandem_pb2.StoredResponse(response_id="resp_alices", body_json='{"output": []}')
        for call in (lambda: stub.PutStoredResponse(put, timeout=10), lambda: stub.GetStoredResponse(ref, timeout=10),
                     lambda: stub.DeleteStoredResponse(ref, timeout=10)):
            assert _code(call)[0] == grpc.StatusCode.UNAUTHENTICATED
        stub.PutStoredResponse(put, metadata=as_alice, timeout=10)
        assert _code(lambda: stub.GetStoredResponse(ref, metadata=as_bob, timeout=10))[0] == grpc.StatusCode.NOT_FOUND
        assert not stub.DeleteStoredResponse(ref, metadata=as_bob, timeout=10).deleted
        assert stub.GetStoredResponse(ref, metadata=as_alice, timeout=10).body_json == '{"output": []}'
        assert stub.DeleteStoredResponse(ref, metadata=as_alice, timeout=10).deleted
