"""Sessions: multi-turn cache reuse, re-sync after a lost cache, and cancellation."""
import time

import grpc
import pytest

from tandem.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
from tests.conftest import reference_greedy

TURN1 = [11, 22, 33, 44, 55, 66, 77]
TURN2 = [5, 6, 7, 8]


def _release(cluster, session_id):
    for address, stub_class in ((cluster.draft_address, draft_pb2_grpc.DraftServiceStub),
                                (cluster.target_address, target_pb2_grpc.TargetServiceStub)):
        with grpc.insecure_channel(address) as channel:
            reply = stub_class(channel).ReleaseSession(common_pb2.ReleaseSessionRequest(session_id=session_id))
            assert reply.released


@pytest.mark.parametrize("pipeline", [False, True])
def test_second_turn_prefills_only_the_new_turn(random_cluster, tiny_models, pipeline):
    with random_cluster.client() as client:
        session = client.create_session()
        first = client.chat(session, message_ids=TURN1, max_tokens=12, pipeline=pipeline, num_draft_tokens=3)
        second = client.chat(session, message_ids=TURN2, max_tokens=12, pipeline=pipeline, num_draft_tokens=3)
        client.delete_session(session)
    # Turn 1 prefills its prompt; turn 2 only its own tokens plus at most the
    # one or two last committed tokens each service had not run yet.
    assert first.stats.target_prefill_tokens >= len(TURN1)
    assert len(TURN2) <= second.stats.target_prefill_tokens - second.stats.rounds + 1 <= len(TURN2) + 1
    assert second.stats.draft_prefill_tokens <= len(TURN2) + 2 * second.stats.rounds + 2
    assert second.stats.cache_misses == 0
    history = TURN1 + first.token_ids + TURN2
    assert second.token_ids == reference_greedy(tiny_models["target"], history, 12)


def test_lost_caches_are_resynced_and_output_unchanged(random_cluster, tiny_models):
    with random_cluster.client() as client:
        session = client.create_session()
        first = client.chat(session, message_ids=TURN1, max_tokens=10, num_draft_tokens=2)
        _release(random_cluster, session)  # what an eviction or a restart leaves behind
        second = client.chat(session, message_ids=TURN2, max_tokens=10, num_draft_tokens=2)
        client.delete_session(session)
    assert second.stats.cache_misses == 2  # one per service, each followed by a full re-sync
    history = TURN1 + first.token_ids + TURN2
    assert second.stats.target_prefill_tokens >= len(history)
    assert second.token_ids == reference_greedy(tiny_models["target"], history, 10)


def test_cancelled_request_keeps_committed_tokens_and_next_turn_is_exact(random_cluster, tiny_models):
    with random_cluster.client() as client:
        session = client.create_session()
        stream = client.chat_stream(session, message_ids=TURN1, max_tokens=60, num_draft_tokens=4, pipeline=True)
        streamed = []
        for event in stream:
            streamed.extend(event.delta.token_ids)
            if len(streamed) >= 5:
                stream.cancel()
                break
        for _ in range(100):  # the server may still be unwinding the cancelled call
            try:
                second = client.chat(session, message_ids=TURN2, max_tokens=10, num_draft_tokens=3)
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.ABORTED  # "session busy"
                time.sleep(0.1)
        record = random_cluster.run(random_cluster.orchestrator.store.load("default", session))
        client.delete_session(session)
    committed_turn1 = record.tokens[len(TURN1): len(record.tokens) - len(TURN2) - 10]
    assert record.tokens[: len(TURN1)] == TURN1
    assert committed_turn1[: len(streamed)] == streamed  # nothing streamed is lost
    assert committed_turn1 == reference_greedy(tiny_models["target"], TURN1, len(committed_turn1))
    history = TURN1 + committed_turn1 + TURN2
    assert second.token_ids == reference_greedy(tiny_models["target"], history, 10)
    assert record.tokens == history + second.token_ids
    # Both services continued from their caches: the right prefix, no re-sync.
    assert second.stats.cache_misses == 0
    assert second.stats.target_prefill_tokens <= len(TURN2) + second.stats.rounds + 1


def test_session_cache_store_evicts_least_recently_used():
    import torch

    from tandem.session_cache import CacheMiss, SessionCacheStore

    class FakeKV:
        def __init__(self):
            self.layers = [type("L", (), {"keys": torch.zeros(0), "values": torch.zeros(0)})()]

        def crop(self, n):
            pass

    store = SessionCacheStore(FakeKV, budget_bytes=200)
    evicted = []
    for name in ("a", "b", "c"):  # as the services do: use a session, then enforce the budget
        cache, _ = store.checkout(name, 0, 0)
        cache.append([1, 2, 3])
        cache.kv.layers[0].keys = torch.zeros(10)  # 40 bytes + 3 tokens * 16 = 88 bytes each
        evicted += store.enforce_budget(keep=name)
    assert evicted == ["a"] and "b" in store and "c" in store
    assert store.total_bytes() == 176 and store.counters.evictions == 1
    with pytest.raises(CacheMiss):
        store.checkout("a", 3, 0)
    cache, cropped = store.checkout("b", 2, store._sessions["b"].fps[1])
    assert cropped == 1 and cache.tokens == [1, 2]


def test_cache_budget_counts_what_a_cropped_verify_still_holds(tiny_models):
    """A verify crops its rejected drafts by slicing; the slice still holds their
    keys and values until the session's next forward, and the budget must see them."""
    from transformers import AutoConfig

    from tandem.modeling import ModelConfig, ModelRunner, load
    from tandem.sampling import SamplingParams
    from tandem.session_cache import SessionCacheStore
    from target_service.verifier import Verifier, VerifyCall

    runner = ModelRunner(load(ModelConfig(tiny_models["target"], dtype="float32")), "cpu")
    store = SessionCacheStore(runner.new_cache)
    prompt = [1, 2, 3, 4]
    greedy = reference_greedy(tiny_models["target"], prompt, 1)[0]
    drafts = [(greedy + 1) % 128] + [5] * 15  # the first draft token is rejected
    outcome = Verifier(runner, store).verify(VerifyCall("s", 0, 0, prompt, drafts, [], None, SamplingParams()))
    assert outcome.accepted == 0 and outcome.next_token == greedy
    config = AutoConfig.from_pretrained(tiny_models["target"])
    head_dim = config.hidden_size // config.num_attention_heads
    per_position = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4  # keys + values, fp32
    held_positions = len(prompt) + len(drafts)
    assert store.total_bytes() == per_position * held_positions + 16 * len(prompt)


def test_a_request_takes_the_session_as_the_previous_request_left_it():
    """A request loads its session before it takes the session's lock. Under the
    lock it takes the service lengths the previous holder saved; if that holder
    also committed tokens, the request is refused (ABORTED upstream), since its
    turn was built on the old history."""
    import asyncio

    from orchestrator.store import SessionBusy, SessionStore
    from tests.conftest import REDIS_URL

    async def scenario():
        store = SessionStore(REDIS_URL)
        try:
            session = (await store.create("t-refresh")).session_id
            await store.append_tokens(await store.load("t-refresh", session), [5, 6, 7])
            waiting = await store.load("t-refresh", session)  # loaded, then waits for the lock
            holder = await store.load("t-refresh", session)
            holder.draft_len, holder.target_len = 3, 2
            await store.save_meta(holder)  # the holder's finally
            async with store.lock(waiting):
                await store.refresh(waiting)
            assert (waiting.draft_len, waiting.target_len) == (3, 2)
            stale = await store.load("t-refresh", session)
            await store.append_tokens(holder, [8])  # the holder committed another token
            async with store.lock(stale):
                with pytest.raises(SessionBusy):
                    await store.refresh(stale)
            await store.delete("t-refresh", session)
        finally:
            await store.close()

    asyncio.run(scenario())


def _redis_server(port: int):
    """A private redis-server on `port`, answering when returned."""
    import subprocess

    import redis

    from tandem.redis_local import redis_binary

    proc = subprocess.Popen([redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def test_a_redis_outage_answers_unavailable_with_words_and_service_resumes(tiny_models):
    """The session store goes down: requests end with UNAVAILABLE naming it
    (not UNKNOWN), and the model services are untouched. Redis comes back (empty:
    this one keeps nothing on disk): new sessions work and decode exactly."""
    from tandem.launch import free_port
    from tests.conftest import Cluster

    port = free_port()
    redis_proc = _redis_server(port)
    cluster = Cluster(tiny_models["target"], tiny_models["other"], redis_url=f"redis://127.0.0.1:{port}/0")
    try:
        with cluster.client() as client:
            session = client.create_session()
            client.chat(session, message_ids=TURN1, max_tokens=6)
            redis_proc.terminate()
            redis_proc.wait(10)
            for call in (lambda: client.chat(session, message_ids=TURN2, max_tokens=6),
                         lambda: client.generate(prompt_ids=TURN1, max_tokens=6), client.create_session):
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "session store (Redis) is unavailable" in info.value.details()

            redis_proc = _redis_server(port)
            session = client.create_session()
            again = client.chat(session, message_ids=TURN1, max_tokens=6)
            assert again.token_ids == reference_greedy(tiny_models["target"], TURN1, 6)
    finally:
        cluster.stop()
        redis_proc.kill()


def _tenant_keys(tenant: str) -> dict[str, int]:
    """The session store's keys of `tenant`, with their TTLs (-1: none)."""
    import redis

    from tests.conftest import REDIS_URL

    client = redis.Redis.from_url(REDIS_URL)
    try:
        return {key.decode(): client.ttl(key) for key in client.keys(f"tandem:{tenant}:*")}
    finally:
        client.close()


def test_a_session_deleted_while_it_generates_ends_the_stream_and_leaves_nothing(random_cluster):
    tenant = f"deleted-{time.monotonic_ns()}"
    with random_cluster.client(tenant=tenant) as client, random_cluster.client(tenant=tenant) as other:
        session = client.create_session()
        stream = client.chat_stream(session, message_ids=TURN1, max_tokens=400, num_draft_tokens=2)
        assert next(stream).delta.token_ids
        assert other.delete_session(session)
        with pytest.raises(grpc.RpcError) as info:
            for _ in stream:
                pass
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "deleted" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            client.chat(session, message_ids=TURN2, max_tokens=2)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert _tenant_keys(tenant) == {}  # the generation's last writes did not re-create it


def test_a_generate_dropped_by_grpc_cleans_up_inner_first(random_cluster):
    """On a client's cancel, grpc.aio may drop a handler's generator, which
    finalizes it outermost first. Generate deletes its session in its own
    cleanup; the generation must have saved and unlocked the session before."""
    import asyncio
    import gc

    from tandem.v1 import tandem_pb2

    tenant = f"dropped-{time.monotonic_ns()}"

    class Context:
        def invocation_metadata(self):
            return (("x-tandem-tenant", tenant),)

        async def abort(self, code, details):
            raise AssertionError(f"aborted: {code} {details}")

    async def scenario():
        request = tandem_pb2.GenerateRequest(params=tandem_pb2.GenerationParams(max_tokens=100))
        request.token_ids.ids.extend(TURN1)
        handler = random_cluster.orchestrator.Generate(request, Context())
        assert (await handler.__anext__()).delta.token_ids
        await handler.aclose()
        for _ in range(10):  # anything left to finalize runs now
            gc.collect()
            await asyncio.sleep(0.02)

    random_cluster.run(scenario())
    assert _tenant_keys(tenant) == {}


def test_the_session_lock_is_renewed_by_commits_and_a_lost_lock_stops_the_request():
    import asyncio

    from orchestrator.store import SessionBusy, SessionStore
    from tests.conftest import REDIS_URL

    async def scenario():
        store = SessionStore(REDIS_URL, lock_s=1)
        try:
            record = await store.create("t-lock")
            async with store.lock(record):
                for _ in range(4):  # 1.6 s in all, renewed as it goes
                    await asyncio.sleep(0.4)
                    await store.append_tokens(record, [1])
                with pytest.raises(SessionBusy):  # still held: a second request is refused
                    async with store.lock(await store.load("t-lock", record.session_id)):
                        pass
                await asyncio.sleep(1.2)  # no commit for longer than the lock lives
                with pytest.raises(SessionBusy, match="lost the session's lock"):
                    await store.append_tokens(record, [2])
            assert (await store.load("t-lock", record.session_id)).tokens == [1, 1, 1, 1]
            await store.delete("t-lock", record.session_id)
        finally:
            await store.close()

    asyncio.run(scenario())


def test_an_idle_service_drops_sessions_past_their_ttl(tiny_models):
    """Idle sessions expire on a service that gets no further call, not only on
    the next call's way in."""
    import asyncio

    from tandem.model_service import CacheConfig
    from tandem.modeling import ModelConfig
    from tandem.v1 import target_pb2
    from target_service.server import build_server

    async def scenario():
        server, port, _, servicer = build_server("127.0.0.1:0", ModelConfig(tiny_models["target"], dtype="float32"),
                                                 CacheConfig(budget_mb=0, session_ttl_s=0.3))
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                target = target_pb2_grpc.TargetServiceStub(channel)
                await target.Verify(target_pb2.VerifyRequest(session_id="idle", prefix=common_pb2.PrefixRef(length=0),
                                                             new_tokens=TURN1))
                assert (await target.GetStats(common_pb2.GetStatsRequest())).sessions == 1
                for _ in range(50):  # the TTL, then a sweep (expiry scans at most once a second)
                    await asyncio.sleep(0.1)
                    stats = await target.GetStats(common_pb2.GetStatsRequest())
                    if stats.sessions == 0:
                        break
                assert stats.sessions == 0 and stats.cache_bytes == 0 and stats.evictions == 1
        finally:
            await server.stop(0)

    asyncio.run(scenario())
