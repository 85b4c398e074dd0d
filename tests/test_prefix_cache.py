"""Prefix reuse across stateless requests (orchestrator.prefix_cache): a finished
Generate parks its session, and a later prompt of the same tenant that starts
with its tokens takes it over. The output stays the target alone's, the reused
tokens are not prefilled again, and no tenant sees another's."""
import asyncio
import time
import uuid

import grpc
import pytest

from orchestrator.config import PrefixCacheConfig
from orchestrator.prefix_cache import BLOCK, MIN_FORK, PrefixCache, block_digests, worth_taking
from orchestrator.replica_load import route_key
from orchestrator.store import SessionNotFound, SessionStore
from tandem import fingerprint
from tandem.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
from tests.conftest import REDIS_URL, Cluster, reference_greedy

PROMPT = [(7 * i + 3) % 120 + 1 for i in range(40)]
NEW = [9, 8, 7, 6, 5, 4, 3, 2, 1, 10]


@pytest.fixture(scope="module")
def cluster(tiny_models):
    """Its own cluster, so that no other test's parked sessions are in the way."""
    cluster = Cluster(tiny_models["target"], tiny_models["other"])
    yield cluster
    cluster.stop()


def _holds(address, stub_class, session_id) -> bool:
    """Whether a model service holds the session (releasing it to find out)."""
    with grpc.insecure_channel(address) as channel:
        return stub_class(channel).ReleaseSession(common_pb2.ReleaseSessionRequest(session_id=session_id)).released


def _release_on_services(cluster, session_id) -> list[bool]:
    return [_holds(cluster.draft_address, draft_pb2_grpc.DraftServiceStub, session_id),
            _holds(cluster.target_address, target_pb2_grpc.TargetServiceStub, session_id)]


# --- the logic, against a real Redis ------------------------------------------------
def test_equal_digests_mean_equal_prefixes():
    tokens = list(range(3 * BLOCK + 5))
    digests = block_digests(tokens)
    assert len(digests) == 3  # full blocks only
    changed = tokens[:]
    changed[BLOCK + 2] += 1000  # in the second block
    other = block_digests(changed)
    assert other[0] == digests[0] and other[1] != digests[1] and other[2] != digests[2]
    assert block_digests(tokens[: 2 * BLOCK]) == digests[:2]


def test_a_session_is_taken_only_when_it_keeps_at_least_half_its_tokens():
    assert worth_taking(50, 100) and worth_taking(100, 100)
    assert not worth_taking(49, 100)


def _store_and_cache(sessions=4, ttl_s=600, fork_answers=True):
    """A PrefixCache on the real Redis; the services' release and fork are
    recorded (a fork answers fork_answers)."""
    store = SessionStore(REDIS_URL)
    released, forks = [], []

    async def release(cache_id):
        released.append(cache_id)

    async def fork(source_id, cache_id, length, fp):
        forks.append((source_id, cache_id, length, fp))
        return fork_answers

    cache = PrefixCache(store, PrefixCacheConfig(sessions, ttl_s), uuid.uuid4().hex, release, fork)
    cache.forks = forks
    return store, cache, released


def _scenario(scenario, **cache_args):
    """Runs scenario(store, cache, released, tenant) on a PrefixCache of the real
    Redis (_store_and_cache), for a tenant of its own."""
    async def run():
        store, cache, released = _store_and_cache(**cache_args)
        try:
            await scenario(store, cache, released, f"t-{uuid.uuid4().hex[:8]}")
        finally:
            await store.close()

    asyncio.run(run())


async def _parked(store, cache, tenant, tokens):
    record = await store.create(tenant)
    await store.append_tokens(record, tokens)
    assert await cache.park(record)
    return record


def test_take_cuts_the_parked_tokens_to_the_common_prefix_and_hides_parked_sessions():
    async def scenario(store, cache, released, tenant):
        parked = await _parked(store, cache, tenant, PROMPT + [1, 2, 3])
        with pytest.raises(SessionNotFound):  # parked: no client call reaches it
            await store.load(tenant, parked.session_id)
        prompt = PROMPT + [1, 2, 99, 98]
        record, cached = await cache.take(tenant, prompt)
        assert cached == len(PROMPT) + 2
        # A new id for the client; the caches keep the name the services know.
        assert record.session_id != parked.session_id and record.cache_id == parked.session_id
        with pytest.raises(SessionNotFound):
            await store.load(tenant, parked.session_id)
        assert record.tokens == prompt[:cached]
        assert record.draft_len == record.target_len == 0  # nothing ran on the services here
        assert await cache.take(tenant, prompt) is None  # taken: nobody else gets it
        assert (await store.load(tenant, record.session_id)).tokens == prompt[:cached]  # the owner's again
        await store.delete(tenant, record.session_id)

    _scenario(scenario)


def test_the_whole_prompt_is_never_reused():
    """The turn keeps the prompt's last token: it has to be fed to be decoded after."""
    async def scenario(store, cache, released, tenant):
        await _parked(store, cache, tenant, PROMPT)
        record, cached = await cache.take(tenant, PROMPT)
        assert cached == len(PROMPT) - 1 and record.tokens == PROMPT[:-1]
        await store.delete(tenant, record.session_id)

    _scenario(scenario)


def test_a_shorter_common_prefix_is_copied_and_the_parked_session_stays():
    """Less than half the parked tokens in common, but MIN_FORK or more: the
    request gets a new session with a copy of the prefix's caches, and the
    parked session is still there for its own conversation."""
    async def scenario(store, cache, released, tenant):
        conversation = PROMPT + list(range(1, 61))  # 100 tokens
        parked = await _parked(store, cache, tenant, conversation)
        prompt = PROMPT[:36] + NEW
        record, cached = await cache.take(tenant, prompt)
        assert cached == 36 and record.tokens == PROMPT[:36]
        assert record.draft_len == record.target_len == 36  # both services hold the copy
        assert cache.forks == [(parked.session_id, record.cache_id, 36, fingerprint.of(PROMPT[:36]))]
        assert record.session_id != parked.session_id != record.cache_id
        # The copy's caches are named so that service replicas place them with their source's.
        assert route_key(record.cache_id) == route_key(parked.cache_id)
        assert (await store.load(tenant, record.session_id)).cache_id == record.cache_id
        taken, cached = await cache.take(tenant, conversation + NEW)  # the parked one is still there
        assert taken.cache_id == parked.session_id and cached == len(conversation)
        for session in (record, taken):
            await store.delete(tenant, session.session_id)

    _scenario(scenario)


def test_a_copy_the_services_cannot_make_leaves_nothing_behind():
    async def scenario(store, cache, released, tenant):
        parked = await _parked(store, cache, tenant, PROMPT + list(range(1, 61)))
        assert await cache.take(tenant, PROMPT[:36] + NEW) is None
        assert len(cache.forks) == 1
        keys = {key.decode() for key in await store.redis.keys(f"tandem:{tenant}:session:*")}
        assert keys == {SessionStore._key(tenant, parked.session_id) + suffix for suffix in ("", ":tokens")}

    _scenario(scenario, fork_answers=False)


def test_a_common_prefix_shorter_than_min_fork_is_not_copied():
    async def scenario(store, cache, released, tenant):
        await _parked(store, cache, tenant, PROMPT + list(range(1, 61)))
        assert await cache.take(tenant, PROMPT[:MIN_FORK - 1] + NEW) is None
        assert cache.forks == []

    _scenario(scenario)


def test_only_one_of_two_concurrent_requests_takes_a_parked_session():
    async def scenario(store, cache, released, tenant):
        await _parked(store, cache, tenant, PROMPT)
        results = await asyncio.gather(*(cache.take(tenant, PROMPT + NEW) for _ in range(4)))
        taken = [r for r in results if r is not None]
        assert len(taken) == 1
        await store.delete(tenant, taken[0][0].session_id)

    _scenario(scenario)


def test_parked_sessions_over_the_limit_go_oldest_first_in_redis_and_on_the_services():
    async def scenario(store, cache, released, tenant):
        first = await _parked(store, cache, tenant, PROMPT)
        await asyncio.sleep(0.002)
        second = await _parked(store, cache, tenant, [5] * 40)
        await asyncio.sleep(0.002)
        assert released == []
        third = await _parked(store, cache, tenant, [6] * 40)
        assert released == [first.session_id]
        assert not await store.redis.exists(SessionStore._key(tenant, first.session_id))
        assert await cache.take(tenant, PROMPT + NEW) is None
        for record, tokens in ((second, [5] * 40), (third, [6] * 40)):
            taken, cached = await cache.take(tenant, tokens + NEW)
            assert taken.cache_id == record.session_id and cached == 40
            await store.delete(tenant, taken.session_id)

    _scenario(scenario, sessions=2)


def test_parked_sessions_past_their_ttl_are_dropped():
    async def scenario(store, cache, released, tenant):
        old = await _parked(store, cache, tenant, PROMPT)
        await asyncio.sleep(1.1)
        await _parked(store, cache, tenant, [5] * 40)  # parking sweeps the parked set
        assert released == [old.session_id]
        assert await cache.take(tenant, PROMPT + NEW) is None

    _scenario(scenario, ttl_s=1)


# --- end to end: real services over gRPC, real Redis -------------------------------
def test_a_prompt_that_extends_a_finished_request_reuses_its_caches(cluster, tiny_models):
    with cluster.client() as client:
        first = client.generate(prompt_ids=PROMPT, max_tokens=12)
        prompt = PROMPT + first.token_ids + NEW
        second = client.generate(prompt_ids=prompt, max_tokens=12, keep_session=True)
        with pytest.raises(grpc.RpcError) as gone:  # parked, then taken over under a new id
            client.delete_session(first.session_id)
        assert client.delete_session(second.session_id)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    # The delete freed the caches on both services, under the name they kept.
    assert _release_on_services(cluster, first.session_id) == [False, False]
    assert first.cached_prompt_tokens == 0
    assert second.session_id != first.session_id
    assert second.cached_prompt_tokens == len(PROMPT) + len(first.token_ids)
    assert second.prompt_tokens == len(prompt)
    assert second.token_ids == reference_greedy(tiny_models["target"], prompt, 12)
    assert second.stats.cache_misses == 0
    # The target ran the new tokens, the one committed token it had not run
    # yet, and a token a round after the first: not the reused prefix.
    assert second.stats.target_prefill_tokens <= len(NEW) + 1 + second.stats.rounds
    assert first.stats.target_prefill_tokens >= len(PROMPT)


def test_a_seeded_sampled_request_gives_the_same_tokens_from_a_parked_session(cluster):
    """Its first round is a plain draw on the target whether the prompt is
    prefilled or its caches are taken over, so the seed decides the tokens.
    (When a taken-over prompt's first round verified a drafted block, 7 of
    these 8 seeds gave other tokens the second time.)"""
    for seed in range(8):
        prompt = [(9 * i + 4 + seed) % 120 + 1 for i in range(40)]
        with cluster.client(tenant=f"seeded-{time.time_ns()}") as client:
            runs = [client.generate(prompt_ids=prompt, max_tokens=24, temperature=1.0, seed=seed) for _ in range(2)]
        assert [r.cached_prompt_tokens for r in runs] == [0, len(prompt) - 1]
        assert runs[1].token_ids == runs[0].token_ids, seed


def test_a_request_of_another_tenant_does_not_reuse_the_caches(cluster, tiny_models):
    prompt_a = [(5 * i + 11) % 120 + 1 for i in range(48)]
    with cluster.client(tenant="alice") as alice, cluster.client(tenant="bob") as bob:
        first = alice.generate(prompt_ids=prompt_a, max_tokens=8)
        prompt = prompt_a + first.token_ids + NEW
        by_bob = bob.generate(prompt_ids=prompt, max_tokens=8)
        by_alice = alice.generate(prompt_ids=prompt, max_tokens=8)
    assert by_bob.cached_prompt_tokens == 0
    assert by_alice.cached_prompt_tokens == len(prompt_a) + len(first.token_ids)
    expected = reference_greedy(tiny_models["target"], prompt, 8)
    assert by_bob.token_ids == expected and by_alice.token_ids == expected


def test_a_short_shared_beginning_does_not_take_a_conversation_over(cluster, tiny_models):
    """A prompt that shares only its first blocks with a parked session leaves
    it for the conversation it belongs to."""
    own = [(3 * i + 17) % 120 + 1 for i in range(40)]
    stranger = own[:BLOCK] + [(11 * i + 2) % 120 + 1 for i in range(30)]
    with cluster.client() as client:
        first = client.generate(prompt_ids=own, max_tokens=20)
        other = client.generate(prompt_ids=stranger, max_tokens=4)
        follow_up = client.generate(prompt_ids=own + first.token_ids + NEW, max_tokens=8)
    assert other.cached_prompt_tokens == 0
    assert follow_up.cached_prompt_tokens == len(own) + len(first.token_ids)
    assert follow_up.token_ids == reference_greedy(tiny_models["target"], own + first.token_ids + NEW, 8)


def test_a_prompt_that_shares_the_beginning_of_a_conversation_starts_from_a_copy(cluster, tiny_models):
    """Both services copy the shared prefix out of the parked session (its own
    next turn still takes the whole of it), and both outputs equal the target alone."""
    own = [(19 * i + 7) % 120 + 1 for i in range(40)]
    shared = own[:36] + NEW  # 36 of the parked 40 + 60 tokens in common: less than half
    with cluster.client() as client:
        first = client.generate(prompt_ids=own, max_tokens=60)
        stats_before = [_stats(cluster.draft_address, draft_pb2_grpc.DraftServiceStub),
                        _stats(cluster.target_address, target_pb2_grpc.TargetServiceStub)]
        copied = client.generate(prompt_ids=shared, max_tokens=10)
        follow_up = client.generate(prompt_ids=own + first.token_ids + NEW, max_tokens=10)
    assert copied.cached_prompt_tokens == 36 and copied.stats.cache_misses == 0
    assert copied.stats.target_prefill_tokens <= len(NEW) + copied.stats.rounds
    assert copied.token_ids == reference_greedy(tiny_models["target"], shared, 10)
    assert follow_up.cached_prompt_tokens == len(own) + len(first.token_ids)
    assert follow_up.token_ids == reference_greedy(tiny_models["target"], own + first.token_ids + NEW, 10)
    for before, after in zip(stats_before, [_stats(cluster.draft_address, draft_pb2_grpc.DraftServiceStub),
                                            _stats(cluster.target_address, target_pb2_grpc.TargetServiceStub)]):
        assert after.cache_misses == before.cache_misses and after.forks == before.forks + 1


def _stats(address, stub_class):
    with grpc.insecure_channel(address) as channel:
        return stub_class(channel).GetStats(common_pb2.GetStatsRequest())


def test_caches_lost_while_parked_are_resynced_and_the_output_is_unchanged(cluster, tiny_models):
    prompt_a = [(13 * i + 1) % 120 + 1 for i in range(36)]
    with cluster.client() as client:
        first = client.generate(prompt_ids=prompt_a, max_tokens=10)
        assert _release_on_services(cluster, first.session_id) == [True, True]  # parked on both
        prompt = prompt_a + first.token_ids + NEW
        second = client.generate(prompt_ids=prompt, max_tokens=10)
    assert second.cached_prompt_tokens == len(prompt_a) + len(first.token_ids)
    assert second.stats.cache_misses == 2  # one a service, each followed by a re-sync
    assert second.token_ids == reference_greedy(tiny_models["target"], prompt, 10)


def test_a_cancelled_or_kept_request_is_not_parked(cluster):
    import redis

    prompt_a = [(17 * i + 5) % 120 + 1 for i in range(40)]
    tenant = f"cancel-{uuid.uuid4().hex[:8]}"
    with cluster.client(tenant=tenant) as client, redis.Redis.from_url(REDIS_URL) as store:
        stream = client.generate_stream(prompt_ids=prompt_a, max_tokens=200, num_draft_tokens=2)
        assert next(stream).HasField("delta")
        stream.cancel()
        # Until its cleanup is done the cancelled request still shares its prompt (a copy
        # of it would be fair then); once done, nothing of it is left, parked or shared.
        deadline = time.monotonic() + 30
        while store.keys(f"tandem:{tenant}:*") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not store.keys(f"tandem:{tenant}:*")
        kept = client.generate(prompt_ids=prompt_a, max_tokens=6, keep_session=True)
        again = client.generate(prompt_ids=prompt_a + kept.token_ids + NEW, max_tokens=4)
        assert client.delete_session(kept.session_id)  # still the client's
    assert kept.cached_prompt_tokens == 0  # the cancelled request's session was deleted, not parked
    assert again.cached_prompt_tokens == 0  # the kept session is not parked either


def test_with_the_prefix_cache_off_a_finished_session_is_deleted(tiny_models):
    off = Cluster(tiny_models["target"], tiny_models["other"], prefix_cache=PrefixCacheConfig(sessions=0))
    try:
        with off.client() as client:
            first = client.generate(prompt_ids=PROMPT, max_tokens=6)
            second = client.generate(prompt_ids=PROMPT + first.token_ids + NEW, max_tokens=6)
        assert second.cached_prompt_tokens == 0
        assert _release_on_services(off, first.session_id) == [False, False]
    finally:
        off.stop()


def test_the_prefix_probe_reuses_caches_on_one_side_only_and_gets_the_same_replies(char_models, tmp_path):
    """bench.prefix_probe on the tiny pair: real processes, two orchestrators in
    front of the same services, the same conversations through the HTTP API."""
    import json

    from bench.prefix_probe import main

    out = tmp_path / "prefix_probe.json"
    assert main(["--target", char_models["target"], "--draft", char_models["draft"], "--draft-args", "", "--dtype", "float32",
                 "--chats", "stack,csv", "--turns", "3", "--new-tokens", "8", "--system", "none",
                 "--out", str(out)]) == 0  # the shared system prompt alone is past the tiny models' window
    result = json.loads(out.read_text())
    on, off = result["modes"]["cache_on"], result["modes"]["cache_off"]
    assert on["requests"] == off["requests"] == 6 and result["identical"] == 6
    assert off["cached_tokens"] == 0 and on["cached_tokens"] > 0
    assert on["prompt_tokens"] == off["prompt_tokens"]
    assert on["target_prefill_tokens"] <= off["target_prefill_tokens"] - on["cached_tokens"] + on["requests"]
    assert all(r["cached_tokens"] > 0 for r in result["runs"]["cache_on"] if r["turn"] > 0)


def test_the_prefix_probes_choices_copy_the_prompt_on_one_side_only_and_are_the_same(char_models, tmp_path):
    """bench.prefix_probe --choices: one request of n greedy choices a chat;
    the side with the cache prefills each prompt once, and both sides give
    the same choices."""
    import json

    from bench.prefix_probe import main

    out = tmp_path / "prefix_probe.json"
    assert main(["--target", char_models["target"], "--draft", char_models["draft"], "--draft-args", "", "--dtype", "float32",
                 "--chats", "stack,csv", "--choices", "3", "--new-tokens", "8", "--system", "none",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    on, off = result["modes"]["cache_on"], result["modes"]["cache_off"]
    assert on["requests"] == off["requests"] == 2 and result["identical"] == 2
    assert on["prompt_tokens"] == off["prompt_tokens"]
    for row_on, row_off in zip(result["runs"]["cache_on"], result["runs"]["cache_off"]):
        prompt = row_on["prompt_tokens"]
        assert row_off["target_prefill_tokens"] >= 3 * prompt  # each choice prefilled it
        assert row_on["target_prefill_tokens"] < prompt + 2 * (prompt - MIN_FORK)  # the later two copied it


def test_fork_session_refuses_bad_input_with_invalid_argument(cluster):
    for address, stub_class in ((cluster.draft_address, draft_pb2_grpc.DraftServiceStub),
                                (cluster.target_address, target_pb2_grpc.TargetServiceStub)):
        with grpc.insecure_channel(address) as channel:
            stub = stub_class(channel)
            for request, words in (
                (common_pb2.ForkSessionRequest(source_session_id="a", session_id="a",
                                               prefix=common_pb2.PrefixRef(length=1)), "into itself"),
                (common_pb2.ForkSessionRequest(source_session_id="a", session_id="b"), "prefix.length"),
                (common_pb2.ForkSessionRequest(session_id="b", prefix=common_pb2.PrefixRef(length=1)), "required"),
            ):
                with pytest.raises(grpc.RpcError) as caught:
                    stub.ForkSession(request)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in caught.value.details()
            missing = stub.ForkSession(common_pb2.ForkSessionRequest(
                source_session_id="no-such-session", session_id="b", prefix=common_pb2.PrefixRef(length=3)))
            assert not missing.forked


def test_a_kept_conversation_that_started_from_a_parked_session_continues_with_chat(char_models):
    """Generate(messages, keep_session) takes over the session the conversation's
    last stateless turn parked; Chat then continues it exactly as it continues
    one that prefilled everything (the same cluster with the cache off)."""
    system = {"role": "system", "content": "Answer in one line."}
    replies = {}
    for sessions in (32, 0):
        cluster = Cluster(char_models["target"], char_models["draft"],
                          prefix_cache=PrefixCacheConfig(sessions=sessions))
        try:
            with cluster.client() as client:
                messages = [system, {"role": "user", "content": "name a color"}]
                first = client.generate(messages=messages, max_tokens=16)
                messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "another"}]
                kept = client.generate(messages=messages, max_tokens=16, keep_session=True)
                follow = client.chat(kept.session_id, "and one more", max_tokens=16)
                assert client.delete_session(kept.session_id)
            replies[sessions] = (first.token_ids, kept.token_ids, follow.token_ids, kept.cached_prompt_tokens,
                                 follow.stats.target_prefill_tokens)
        finally:
            cluster.stop()
    on, off = replies[32], replies[0]
    assert on[:3] == off[:3]
    assert on[3] >= len(on[0]) and off[3] == 0
    assert on[4] == off[4]  # Chat prefilled only its new turn either way
