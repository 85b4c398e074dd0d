"""A running stateless request shares its prompt (PrefixCache.share): one of the
same tenant that starts alike copies the running session's caches of the
common prefix instead of prefilling it, and the HTTP API's choices of one
prompt let the first go ahead so that the others can. Outputs stay the target
alone's."""
import asyncio
import json
import urllib.request
import uuid

import grpc
import pytest

from orchestrator.config import PrefixCacheConfig
from orchestrator.http_gateway import SHARED_TEXT, shares_prefix
from orchestrator.openai_api import chat_call, completion_call
from orchestrator.prefix_cache import MIN_FORK, PrefixCache
from orchestrator.store import SessionStore
from tandem import fingerprint
from tandem.client import collect
from tandem.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
from tests.conftest import REDIS_URL, Cluster, reference_greedy

PROMPT = [(11 * i + 5) % 120 + 1 for i in range(60)]


@pytest.fixture(scope="module")
def cluster(tiny_models):
    cluster = Cluster(tiny_models["target"], tiny_models["other"])
    yield cluster
    cluster.stop()


def _forks(cluster) -> list[int]:
    counts = []
    for address, stub in ((cluster.draft_address, draft_pb2_grpc.DraftServiceStub),
                          (cluster.target_address, target_pb2_grpc.TargetServiceStub)):
        with grpc.insecure_channel(address) as channel:
            counts.append(stub(channel).GetStats(common_pb2.GetStatsRequest()).forks)
    return counts


def test_a_request_starts_from_a_copy_of_a_running_one_with_the_same_prompt(cluster, tiny_models):
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    before = _forks(cluster)
    with cluster.client(tenant=tenant) as client:
        running = client.generate_stream(prompt_ids=PROMPT, max_tokens=200, ignore_eos=True)
        first = next(running)  # its first round is done: both services hold the prompt
        assert first.HasField("delta")
        copied = client.generate(prompt_ids=PROMPT, max_tokens=12)
        forks = _forks(cluster)
        rest = collect(running)
    assert copied.cached_prompt_tokens == len(PROMPT) - 1 and copied.stats.cache_misses == 0
    assert copied.stats.target_prefill_tokens <= copied.stats.rounds + 1  # the prompt was not prefilled again
    assert copied.token_ids == reference_greedy(tiny_models["target"], PROMPT, 12)
    assert list(first.delta.token_ids) + rest.token_ids == reference_greedy(tiny_models["target"], PROMPT, 200)
    assert forks == [n + 1 for n in before]  # a copy on both services (a parked session is taken over instead)


def test_a_running_prompt_is_not_shared_with_another_tenant(cluster, tiny_models):
    prompt = [(13 * i + 2) % 120 + 1 for i in range(50)]
    with cluster.client(tenant=f"t-{uuid.uuid4().hex[:8]}") as owner, \
            cluster.client(tenant=f"u-{uuid.uuid4().hex[:8]}") as other:
        running = owner.generate_stream(prompt_ids=prompt, max_tokens=200, ignore_eos=True)
        next(running)
        alone = other.generate(prompt_ids=prompt, max_tokens=6)
        running.cancel()
    assert alone.cached_prompt_tokens == 0 and alone.token_ids == reference_greedy(tiny_models["target"], prompt, 6)


def test_a_shared_prompt_is_withdrawn_when_its_session_ends_and_only_its_own_keys_go():
    async def scenario():
        store = SessionStore(REDIS_URL)
        forks = []

        async def fork(source_id, cache_id, length, fp):
            forks.append((source_id, length, fp))
            return True

        async def release(cache_id):
            pass

        cache = PrefixCache(store, PrefixCacheConfig(4, 600), uuid.uuid4().hex, release, fork)
        tenant = f"t-{uuid.uuid4().hex[:8]}"
        try:
            first = await store.create(tenant)
            await store.append_tokens(first, PROMPT + [7, 7])
            await cache.share(first, PROMPT)
            record, cached = await cache.take(tenant, PROMPT[:40] + [99])
            assert cached == 40 and forks == [(first.session_id, 40, fingerprint.of(PROMPT[:40]))]
            assert record.tokens == PROMPT[:40]
            # A second session shares the same prompt; the first's end leaves the second's offer.
            second = await store.create(tenant)
            await store.append_tokens(second, PROMPT)
            await cache.share(second, PROMPT)
            await cache.unshare(first, PROMPT)
            await cache.take(tenant, PROMPT)
            assert forks[-1][0] == second.session_id
            await cache.unshare(second, PROMPT)
            assert await cache.take(tenant, PROMPT) is None and len(forks) == 2
            # Too short to copy: nothing is offered.
            assert cache.shareable(PROMPT[:MIN_FORK]) == []
        finally:
            for session in await store.redis.keys(f"tandem:{tenant}:*"):
                await store.redis.delete(session)
            await store.close()

    asyncio.run(scenario())


def test_which_choices_go_one_after_the_first():
    long_text = "x" * SHARED_TEXT
    ask = [{"role": "user", "content": "hi"}]
    assert shares_prefix(completion_call({"prompt": long_text, "n": 2}))
    assert not shares_prefix(completion_call({"prompt": "short", "n": 2}))
    assert not shares_prefix(completion_call({"prompt": long_text}))
    assert shares_prefix(completion_call({"prompt": [long_text + " a", long_text + " b"]}))
    assert not shares_prefix(completion_call({"prompt": [long_text, "y" + long_text]}))
    assert shares_prefix(completion_call({"prompt": [PROMPT + [1], PROMPT + [2]]}))
    assert not shares_prefix(completion_call({"prompt": [PROMPT[:MIN_FORK] + [1], PROMPT[:MIN_FORK] + [2]]}))
    assert shares_prefix(chat_call({"messages": ask, "n": 3})) and not shares_prefix(chat_call({"messages": ask}))
    assert not shares_prefix(chat_call({"messages": ask, "n": 3, "seed": 1}))  # sampled (temperature 1)
    assert shares_prefix(chat_call({"messages": ask, "n": 3, "seed": 1, "temperature": 0}))


def test_the_choices_of_one_prompt_over_http_prefill_it_once(tiny_models):
    """n = 3 of a long prompt: the first goes ahead, the other two copy its
    caches (two forks on each service), and all three equal the target alone."""
    from tests.test_http_api import _gateway

    cluster = Cluster(tiny_models["target"], tiny_models["other"])
    base, stop = _gateway(cluster)
    try:
        before = _forks(cluster)
        for stream in (False, True):
            body = json.dumps({"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "n": 3, "ignore_eos": True,
                               "return_token_ids": True, "stream": stream}).encode()
            request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as reply:
                raw = reply.read().decode()
            if stream:
                ids = {i: [] for i in range(3)}
                for line in raw.splitlines():
                    if line.startswith("data: {"):
                        for choice in json.loads(line[6:])["choices"]:
                            ids[choice["index"]] += choice.get("token_ids") or []
                got = [ids[i] for i in range(3)]
            else:
                got = [c["token_ids"] for c in sorted(json.loads(raw)["choices"], key=lambda c: c["index"])]
            assert got == [reference_greedy(tiny_models["target"], PROMPT, 40)] * 3
            after = _forks(cluster)
            # Choices 1 and 2 copied choice 0's caches (in the second request choice 0 took
            # over a parked session of the first, and they copied that one's).
            assert after == [n + 2 for n in before]
            before = after
    finally:
        stop()
        cluster.stop()
