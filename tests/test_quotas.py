"""Per-tenant quotas (--tenant-max-requests, --tenant-tokens-per-minute), kept
in the real Redis: a tenant past its quota is refused with RESOURCE_EXHAUSTED
and words, other tenants are not, and the places free up."""
import asyncio
import time
import uuid

import grpc
import pytest
import redis

from orchestrator.config import QuotaConfig
from orchestrator.quotas import QuotaExceeded, TenantQuotas, usage_key
from orchestrator.store import SessionStore
from tests.conftest import REDIS_URL, Cluster

PROMPT = [(5 * i) % 120 + 1 for i in range(10)]


def _tenant() -> str:
    return f"q-{uuid.uuid4().hex[:8]}"


def test_two_replicas_share_a_tenants_running_limit_and_a_lapsed_lease_frees_its_place():
    async def run():
        store = SessionStore(REDIS_URL)
        replicas = [TenantQuotas(store.redis, QuotaConfig(max_requests=2), lease_s=1.0) for _ in range(2)]
        tenant, other = _tenant(), _tenant()
        async with replicas[0].admit(tenant), replicas[1].admit(tenant):
            with pytest.raises(QuotaExceeded, match="limit of 2 requests"):
                async with replicas[0].admit(tenant):
                    pass
            async with replicas[1].admit(other):  # another tenant's quota is its own
                pass
        async with replicas[0].admit(tenant), replicas[1].admit(tenant):  # both places were given back
            pass
        # A replica that died holding a place: its lease lapses.
        await store.redis.zadd(f"tandem:{tenant}:running", {"dead-1": time.time() + 1.0, "dead-2": time.time() + 1.0})
        with pytest.raises(QuotaExceeded):
            async with replicas[0].admit(tenant):
                pass
        await asyncio.sleep(1.1)
        async with replicas[0].admit(tenant):
            pass
        await store.close()

    asyncio.run(run())


def test_a_running_request_keeps_renewing_its_lease():
    async def run():
        store = SessionStore(REDIS_URL)
        quotas = TenantQuotas(store.redis, QuotaConfig(max_requests=1), lease_s=0.6)
        tenant = _tenant()
        async with quotas.admit(tenant):
            await asyncio.sleep(1.5)  # past two leases
            with pytest.raises(QuotaExceeded):
                async with quotas.admit(tenant):
                    pass
        await store.close()

    asyncio.run(run())


def test_committed_tokens_count_against_the_tenants_minute(tiny_models):
    cluster = Cluster(tiny_models["target"], tiny_models["other"], quotas=QuotaConfig(tokens_per_minute=40))
    tenant, other = _tenant(), _tenant()
    try:
        if time.time() % 60 > 50:  # keep the three requests in one minute's window
            time.sleep(61 - time.time() % 60)
        with cluster.client(tenant=tenant) as client, cluster.client(tenant=other) as stranger:
            first = client.generate(prompt_ids=PROMPT, max_tokens=12)
            used = int(redis.Redis.from_url(REDIS_URL).get(usage_key(tenant)))
            assert used == len(PROMPT) + len(first.token_ids) == 22
            second = client.generate(prompt_ids=PROMPT[::-1], max_tokens=24)  # admitted at 22: runs to its end
            assert len(second.token_ids) == 24
            with pytest.raises(grpc.RpcError) as caught:
                client.generate(prompt_ids=PROMPT, max_tokens=4)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "committed 56 tokens this minute, its limit is 40" in caught.value.details()
            assert "retry in" in caught.value.details()
            assert len(stranger.generate(prompt_ids=PROMPT, max_tokens=4).token_ids) == 4
    finally:
        cluster.stop()


def test_a_tenant_at_its_running_limit_is_refused_and_others_are_served(tiny_models):
    cluster = Cluster(tiny_models["target"], tiny_models["other"], quotas=QuotaConfig(max_requests=1))
    tenant, other = _tenant(), _tenant()
    try:
        with cluster.client(tenant=tenant) as client, cluster.client(tenant=other) as stranger:
            info = client.server_info()
            assert (info.tenant_max_requests, info.tenant_tokens_per_minute) == (1, 0)
            assert info.prefix_cache_sessions == 32 and not info.api_keys_required
            held = client.generate_stream(prompt_ids=PROMPT, max_tokens=300, num_draft_tokens=1)
            assert next(held).HasField("delta")  # the tenant's one place is taken
            with pytest.raises(grpc.RpcError) as caught:
                client.generate(prompt_ids=PROMPT, max_tokens=4)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--tenant-max-requests" in caught.value.details()
            assert len(stranger.generate(prompt_ids=PROMPT, max_tokens=4).token_ids) == 4
            for _ in held:  # the held request runs to its end
                pass
            assert len(client.generate(prompt_ids=PROMPT, max_tokens=4).token_ids) == 4
    finally:
        cluster.stop()


def test_a_prefix_reused_from_a_parked_session_is_not_counted(tiny_models):
    """Taken over or copied (--prefix-cache), the reused tokens are free: a
    request counts its prompt's other tokens and what it generates."""
    cluster = Cluster(tiny_models["target"], tiny_models["other"], quotas=QuotaConfig(tokens_per_minute=100_000))
    tenant = _tenant()
    store = redis.Redis.from_url(REDIS_URL)
    own = [(3 * i + 1) % 120 + 1 for i in range(40)]
    try:
        if time.time() % 60 > 50:  # keep the requests in one minute's window
            time.sleep(61 - time.time() % 60)
        with cluster.client(tenant=tenant) as client:
            first = client.generate(prompt_ids=own, max_tokens=60)
            for prompt in (own[:36] + [7, 8, 9], own + first.token_ids + [4, 5, 6]):  # a copy, then a take-over
                before = int(store.get(usage_key(tenant)))
                result = client.generate(prompt_ids=prompt, max_tokens=5)
                assert result.cached_prompt_tokens > 0
                assert int(store.get(usage_key(tenant))) - before == (
                    len(prompt) - result.cached_prompt_tokens + len(result.token_ids))
    finally:
        cluster.stop()
