"""Bad input gets a clear error with the right gRPC status code, and nothing
else is disturbed."""
import grpc
import numpy as np
import pytest

from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.conftest import TINY_VOCAB, Cluster, reference_greedy

PROMPT = [1, 2, 3, 4]


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.details()  # every error says what is wrong
    return info.value.code()


@pytest.mark.parametrize("kwargs", [
    dict(prompt_ids=[]),
    dict(prompt_ids=PROMPT, max_tokens=0),
    dict(prompt_ids=PROMPT, max_tokens=-3),
    dict(prompt_ids=PROMPT, temperature=-0.5),
    dict(prompt_ids=PROMPT, top_p=0.0),
    dict(prompt_ids=PROMPT, top_p=1.5),
    dict(prompt_ids=PROMPT, top_k=-1),
    dict(prompt_ids=PROMPT, max_tokens=600),  # 4 + 600 > the tiny model's 512
    dict(prompt_ids=[1, 500]),  # outside the vocabulary
    dict(prompt="text, but the tiny model has no tokenizer"),
    dict(prompt_ids=PROMPT, stop=["a stop string, but no tokenizer to find it with"]),
    dict(prompt_ids=PROMPT, temperature=float("inf")),
])
def test_bad_generate_requests_are_invalid_argument(random_cluster, kwargs):
    with random_cluster.client() as client:
        assert _code(lambda: client.generate(**kwargs)) == grpc.StatusCode.INVALID_ARGUMENT
        assert client.generate(prompt_ids=PROMPT, max_tokens=3).completion_tokens == 3  # still serving


def test_tokenize_without_a_tokenizer_is_invalid_argument(random_cluster):
    """The tiny models have no tokenizer: only token ids have meaning there."""
    with random_cluster.client() as client:
        assert not client.server_info().tokenizer.eos_token
        for kwargs, words in [(dict(text="hello"), "needs a tokenizer"), (dict(token_ids=[1, 2]), "no tokenizer"),
                              (dict(messages=[{"role": "user", "content": "x"}]), "needs a tokenizer")]:
            with pytest.raises(grpc.RpcError) as caught:
                client.tokenize(**kwargs)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in caught.value.details()


def test_unknown_and_foreign_sessions(random_cluster):
    with random_cluster.client(tenant="alice") as alice, random_cluster.client(tenant="bob") as bob:
        assert _code(lambda: alice.chat("no-such-session", message_ids=[1])) == grpc.StatusCode.NOT_FOUND
        assert _code(lambda: alice.delete_session("no-such-session")) == grpc.StatusCode.NOT_FOUND
        session = alice.create_session()
        first = alice.chat(session, message_ids=PROMPT, max_tokens=4)
        assert _code(lambda: bob.chat(session, message_ids=[1], max_tokens=2)) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: bob.delete_session(session)) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: alice.chat(session, message_ids=[], max_tokens=2)) == grpc.StatusCode.INVALID_ARGUMENT
        # Alice's session is intact after all of that.
        record = random_cluster.run(random_cluster.orchestrator.store.load("alice", session))
        assert record.tokens == PROMPT + first.token_ids
        assert alice.delete_session(session)


def test_mismatched_model_pair_is_refused(tiny_models):
    cluster = Cluster(tiny_models["target"], tiny_models["wide"])
    try:
        with cluster.client() as client:
            assert _code(lambda: client.generate(prompt_ids=PROMPT)) == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(grpc.RpcError) as info:
                client.generate(prompt_ids=PROMPT)
            assert "tokenizer" in info.value.details()
    finally:
        cluster.stop()


def test_a_draft_of_another_wire_version_is_refused(tiny_models):
    """A target that read another revision's draft distributions would sample
    from the wrong residual without a word: the orchestrator pairs the two
    services only where their ModelInfo.wire_version is the same."""
    from tandem.wire import WIRE_VERSION

    cluster = Cluster(tiny_models["target"], tiny_models["target"], draft_fallback=False)
    try:
        info = cluster.draft.model_info()
        assert info.wire_version == WIRE_VERSION == cluster.target.model_info().wire_version
        info.wire_version = 0  # as a service built before the field reports
        cluster.draft.model_info = lambda: info
        with cluster.client() as client:
            with pytest.raises(grpc.RpcError) as refused:
                client.generate(prompt_ids=PROMPT, max_tokens=2)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"wire version 0 and the target service {WIRE_VERSION}" in refused.value.details()
    finally:
        cluster.stop()


def test_a_target_tokenizer_the_orchestrator_cannot_load_is_refused(tiny_models, tmp_path):
    """The target's --model names a directory the orchestrator's machine may not
    have: serving token ids only, silently, would refuse every text request."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    target = tmp_path / "with-tokenizer"
    shutil.copytree(tiny_models["target"], target)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(TINY_VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0").save_pretrained(target)
    for tokenizer, refused in ((tiny_models["other"], True), ("", False)):  # a directory without one; the target's
        cluster = Cluster(str(target), str(target), tokenizer=tokenizer)
        try:
            with cluster.client() as client:
                if refused:
                    with pytest.raises(grpc.RpcError) as info:
                        client.generate(prompt="w5 w6 w7", max_tokens=2)
                    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                    assert "--tokenizer" in info.value.details()
                else:
                    assert client.server_info().has_tokenizer
                    assert client.generate(prompt_ids=[5, 6, 7], max_tokens=2).completion_tokens == 2
        finally:
            cluster.stop()


def _dense(values, vocab_size=TINY_VOCAB):
    return common_pb2.Distribution(dense_f32=np.asarray(values, dtype="<f4").tobytes(), vocab_size=vocab_size)


def _sparse(ids, probs, vocab_size=TINY_VOCAB):
    return common_pb2.Distribution(sparse_ids_i32=np.asarray(ids, dtype="<i4").tobytes(),
                                   sparse_probs_f32=np.asarray(probs, dtype="<f4").tobytes(), vocab_size=vocab_size)


ONE_HOT_5 = _sparse([5], [1.0])
BAD_DRAFT_DISTRIBUTIONS = [  # (draft_distributions, draft_probs) for the draft tokens [5, 6]
    ([ONE_HOT_5, common_pb2.Distribution(dense_f32=b"\0" * 5, vocab_size=TINY_VOCAB)], [1.0, 1.0]),  # 5 bytes
    ([ONE_HOT_5, _sparse([6, 7], [1.0])], [1.0, 1.0]),  # two ids, one probability
    ([ONE_HOT_5, common_pb2.Distribution(sparse_ids_i32=b"\6\0\0", sparse_probs_f32=b"\0\0\x80",
                                         vocab_size=TINY_VOCAB)], [1.0, 1.0]),  # 3 bytes each
    ([ONE_HOT_5, _sparse([500], [1.0])], [1.0, 1.0]),
    ([ONE_HOT_5, _sparse([-1], [1.0])], [1.0, 1.0]),
    ([ONE_HOT_5, _sparse([6], [1.0], vocab_size=0)], [1.0, 1.0]),
    ([ONE_HOT_5, _sparse([6], [1.0], vocab_size=64)], [1.0, 1.0]),  # sizes differ
    ([ONE_HOT_5, _sparse([6], [float("nan")])], [1.0, 1.0]),
    ([ONE_HOT_5, _dense([-1.0] + [0.0] * (TINY_VOCAB - 1))], [1.0, 1.0]),
    ([ONE_HOT_5, common_pb2.Distribution(vocab_size=TINY_VOCAB)], [1.0, 1.0]),  # neither form
    ([ONE_HOT_5, common_pb2.Distribution(dense_f32=_dense([1.0] + [0.0] * (TINY_VOCAB - 1)).dense_f32,
                                         sparse_ids_i32=ONE_HOT_5.sparse_ids_i32,
                                         sparse_probs_f32=ONE_HOT_5.sparse_probs_f32, vocab_size=TINY_VOCAB)],
     [1.0, 1.0]),  # both forms
    ([_sparse([5], [1.0], vocab_size=6)] * 2, [1.0, 1.0]),  # token 6 outside them
    ([ONE_HOT_5, ONE_HOT_5], [1.0, 1.5]),  # a probability above 1
]


SHARED_5_6 = common_pb2.Distribution(shared_ids=True, sparse_probs_f32=np.asarray([0.5, 0.5], dtype="<f4").tobytes(),
                                     vocab_size=TINY_VOCAB)


def _sampled_verify(prefix, dists, probs):
    return target_pb2.VerifyRequest(session_id="s", prefix=prefix, new_tokens=[1], draft_tokens=[5, 6],
                                    draft_probs=probs, draft_distributions=dists,
                                    sampling=common_pb2.SamplingParams(temperature=1.0))


def test_model_services_check_their_input(random_cluster):
    prefix = common_pb2.PrefixRef(length=0)
    with grpc.insecure_channel(random_cluster.target_address) as channel:
        target = target_pb2_grpc.TargetServiceStub(channel)
        bad = [
            target_pb2.VerifyRequest(session_id="s", prefix=prefix, new_tokens=[]),
            target_pb2.VerifyRequest(session_id="", prefix=prefix, new_tokens=[1]),
            target_pb2.VerifyRequest(session_id="s", prefix=prefix, new_tokens=[1000]),
            target_pb2.VerifyRequest(session_id="s", prefix=prefix, new_tokens=[1], draft_tokens=[2],
                                     sampling=common_pb2.SamplingParams(temperature=1.0)),  # no draft probs
            target_pb2.VerifyRequest(session_id="s", prefix=prefix, new_tokens=[1] * 600),  # past the context
            *[_sampled_verify(prefix, dists, probs) for dists, probs in BAD_DRAFT_DISTRIBUTIONS],
            # Rows over shared ids: none sent, or fewer than the rows' probabilities.
            *[target_pb2.VerifyRequest(session_id="s", prefix=prefix, new_tokens=[1], draft_tokens=[5, 6],
                                       draft_probs=[0.5, 0.5], draft_distributions=[SHARED_5_6] * 2,
                                       draft_distribution_ids_i32=ids,
                                       sampling=common_pb2.SamplingParams(temperature=1.0))
              for ids in (b"", np.asarray([5], dtype="<i4").tobytes())],
            # Alternatives: under sampling, unpaired, twice at one position, past the block, outside the vocabulary.
            target_pb2.VerifyRequest(session_id="s", prefix=prefix, new_tokens=[1], draft_tokens=[5, 6],
                                     draft_probs=[1.0, 1.0], draft_distributions=[ONE_HOT_5, ONE_HOT_5],
                                     sampling=common_pb2.SamplingParams(temperature=1.0),
                                     alternative_positions=[0], alternative_tokens=[7]),
            *[target_pb2.VerifyRequest(session_id="s", prefix=prefix, new_tokens=[1], draft_tokens=[5, 6],
                                       alternative_positions=positions, alternative_tokens=tokens)
              for positions, tokens in (([0, 1], [7]), ([1, 1], [7, 8]), ([2], [7]), ([0], [1000]))],
        ]
        for request in bad:
            assert _code(lambda: target.Verify(request)) == grpc.StatusCode.INVALID_ARGUMENT
        stale = target_pb2.VerifyRequest(session_id="never-seen", prefix=common_pb2.PrefixRef(length=5, fingerprint=1),
                                         new_tokens=[1])
        with pytest.raises(grpc.RpcError) as info:
            target.Verify(stale)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert ("tandem-cache-miss", "1") in tuple(info.value.trailing_metadata())
    with grpc.insecure_channel(random_cluster.draft_address) as channel:
        draft = draft_pb2_grpc.DraftServiceStub(channel)
        zero_k = draft_pb2.ProposeRequest(session_id="s", prefix=prefix, new_tokens=[1], num_tokens=0)
        assert _code(lambda: draft.Propose(zero_k)) == grpc.StatusCode.INVALID_ARGUMENT
        # The last proposed token is never run, so 508 + 5 tokens fit a context of 512, and 509 + 5 do not.
        fits = draft_pb2.ProposeRequest(session_id="s2", prefix=prefix, new_tokens=[1] * 508, num_tokens=5)
        assert len(draft.Propose(fits).tokens) == 5
        past = draft_pb2.ProposeRequest(session_id="s3", prefix=prefix, new_tokens=[1] * 509, num_tokens=5)
        with pytest.raises(grpc.RpcError) as info:
            draft.Propose(past)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context window" in info.value.details()
        stale = draft_pb2.ProposeRequest(session_id="never-seen", prefix=common_pb2.PrefixRef(length=3, fingerprint=9),
                                         new_tokens=[1], num_tokens=2)
        assert _code(lambda: draft.Propose(stale)) == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize("argv, words", [  # the orchestrator's own flags: the test after this one
    (["draft", "--model", "/no/such/model"], "no such directory"),
    (["target", "--model", "./missing", "--dtype", "float32"], "no such directory"),
    (["target", "--graphs", "on"], "--graphs on needs a CUDA device, not cpu"),
    (["orchestrator", "--redis-url", "redis://127.0.0.1:1/0"], "connecting to 127.0.0.1:1"),
    (["orchestrator", "--api-keys", "./missing-keys"], "cannot read the API keys file ./missing-keys"),
])
def test_serve_with_bad_flags_exits_2_with_words(argv, words):
    """A service that cannot start says why in one line and exits 2, without a traceback."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "tandem.cli", "serve", *argv, "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"tandem serve {argv[0]}:" in proc.stderr and words in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv, words", [
    (["--k-min", "5", "--k-max", "2"], "k_min <= k <= k_max"),
    (["--service-timeout", "0"], "service_timeout_s must be > 0"),
    (["--max-concurrent-requests", "-1"], "max_concurrent_requests must be >= 0"),
])
def test_the_orchestrators_bad_flags_are_refused_before_torch_or_transformers_load(argv, words):
    """As above, and at once: they took about 15 s to report on a slow 2-core VM
    while the imports ran; here importing either library fails, so the words
    must come before it."""
    import subprocess
    import sys

    script = ("import sys; sys.modules['torch'] = sys.modules['transformers'] = None; "
              "from tandem.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", script, "serve", "orchestrator", *argv, "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "tandem serve orchestrator:" in proc.stderr and words in proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_on_a_busy_port_exits_2_with_words(tiny_models):
    """gRPC servers set SO_REUSEPORT unless told not to: a second target on the
    port of a first one started, and the two split the calls between them."""
    import asyncio
    import subprocess
    import sys

    from tandem import serving

    async def scenario():
        server, port, _ = serving.create_server("127.0.0.1:0", [])
        await server.start()
        try:
            for flags in (["--port", str(port)], ["--port", "0", "--metrics-port", str(port)]):
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "tandem.cli", "serve", "target", "--model", tiny_models["target"],
                    "--dtype", "float32", *flags, stderr=subprocess.PIPE)
                _, stderr = await asyncio.wait_for(proc.communicate(), 120)
                assert proc.returncode == 2, stderr
                assert f"127.0.0.1:{port}" in stderr.decode() and "Traceback" not in stderr.decode()
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_requests_past_the_concurrency_limit_are_refused_and_nothing_else_is_disturbed(tiny_models):
    """With --max-concurrent-requests 1, a Generate or Chat that arrives while
    another streams ends at once with RESOURCE_EXHAUSTED and words; the stream
    in progress and the refused chat's session are untouched, and a request
    after the stream ends is served."""
    cluster = Cluster(tiny_models["target"], tiny_models["other"], max_concurrent_requests=1)
    try:
        with cluster.client() as client:
            session = client.create_session()
            # A random draft: about one token a round, so 400 tokens stream for a while.
            stream = client.generate_stream(prompt_ids=PROMPT, max_tokens=400, num_draft_tokens=2)
            streamed = list(next(stream).delta.token_ids)
            for call in (lambda: client.generate(prompt_ids=PROMPT, max_tokens=5),
                         lambda: client.chat(session, message_ids=PROMPT, max_tokens=5)):
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "limit of 1 concurrent requests" in refused.value.details()
            for event in stream:
                streamed.extend(event.delta.token_ids)
            assert streamed == reference_greedy(tiny_models["target"], PROMPT, 400)
            reply = client.chat(session, message_ids=PROMPT, max_tokens=5)
            record = cluster.run(cluster.orchestrator.store.load("default", session))
            client.delete_session(session)
        assert reply.token_ids == reference_greedy(tiny_models["target"], PROMPT, 5)
        assert record.tokens == PROMPT + reply.token_ids  # the refused turn left nothing behind
        assert cluster.orchestrator.active_requests == 0
    finally:
        cluster.stop()


def test_requests_that_find_the_orchestrator_unpaired_connect_once():
    import asyncio

    from orchestrator.server import OrchestratorConfig, OrchestratorServicer

    async def scenario():
        servicer = OrchestratorServicer(OrchestratorConfig(draft_address="127.0.0.1:1", target_address="127.0.0.1:1"))
        calls = []

        async def connect(wait_s=0.0):
            calls.append(wait_s)
            await asyncio.sleep(0.05)
            servicer.generation = object()

        servicer.connect = connect
        try:
            results = await asyncio.gather(*(servicer._ready(None) for _ in range(5)))
        finally:
            await servicer.close()
        assert len(calls) == 1 and all(r is servicer.generation for r in results)

    asyncio.run(scenario())


def test_a_wrong_gguf_file_is_refused_with_words(tmp_path):
    import subprocess
    import sys

    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(b"not the pinned model" * 100)
    env = {**__import__("os").environ, "TANDEM_MODEL_CACHE": str(tmp_path / "cache")}
    for path, code, words in ((wrong, 1, f"sha256 mismatch for {wrong}"), (tmp_path / "missing.gguf", 2, "no such file")):
        proc = subprocess.run([sys.executable, "-m", "tandem.default_models", "--which", "draft", "--gguf", str(path),
                               "--quiet"], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == code and words in proc.stderr and "Traceback" not in proc.stderr
    assert not any((tmp_path / "cache").glob("qwen*"))  # nothing half-built is left as a model
