"""Several replicas of each model service (orchestrator.replicas): each session's
calls go to one replica, a replica that goes down hands its sessions to the
others without changing an output, and replicas of different models are refused."""
import asyncio
import math
import uuid

import grpc
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from orchestrator.backends import ServiceCacheMiss, ServiceUnavailable
from orchestrator.config import OrchestratorConfig
from orchestrator.load_board import LoadBoard
from orchestrator.replica_load import LOAD_S, PLACED_S, copy_id, hold, placed_id, placed_on_board, route_key
from orchestrator.replicas import Replicas
from tandem import telemetry
from tandem.v1 import common_pb2
from tests.conftest import REDIS_URL, Cluster, reference_greedy

KEYS = [f"{i:032x}" for i in range(600)]


class _Client:
    """A replica's client in the unit tests of placement: answers propose with its address."""

    def __init__(self, address, fails=False):
        self.address, self.fails, self.calls = address, fails, 0

    async def propose(self, session_id, *args):
        self.calls += 1
        if self.fails:
            raise ServiceUnavailable("UNAVAILABLE: connection refused")
        return self.address

    async def close(self):
        pass


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


ADDRESSES = [f"10.0.0.{i}:50052" for i in range(6)]


def _replicas(n=3, failing=(), clock=None, role="target"):
    return Replicas(lambda address: _Client(address, ADDRESSES.index(address) in failing), role,
                    ADDRESSES[:n], clock=clock or _Clock())


def _placement(replicas):
    return {key: replicas.replica_for(key).address for key in KEYS}


def test_sessions_spread_over_the_replicas_and_a_lost_one_moves_only_its_own():
    replicas = _replicas()
    before = _placement(replicas)
    counts = [list(before.values()).count(address) for address in ADDRESSES[:3]]
    assert min(counts) > 150, counts  # 200 each expected
    replicas.replicas[1].down_until = math.inf
    after = _placement(replicas)
    assert all(after[key] == before[key] for key in KEYS if before[key] != ADDRESSES[1])
    assert {after[key] for key in KEYS if before[key] == ADDRESSES[1]} == {ADDRESSES[0], ADDRESSES[2]}
    # Another orchestrator with the same addresses, in any order, places every session alike.
    assert _placement(Replicas(_Client, "target", ADDRESSES[2::-1])) == before


def test_a_replica_that_joins_takes_only_sessions_of_its_own_and_one_that_leaves_gives_up_only_its():
    replicas = _replicas(3)
    before = _placement(replicas)

    async def scenario():
        replicas.update(ADDRESSES[:4])  # a DNS name's new address
        joined = _placement(replicas)
        moved = [key for key in KEYS if joined[key] != before[key]]
        assert moved and all(joined[key] == ADDRESSES[3] for key in moved)
        assert 75 < len(moved) < 225  # a quarter of 600 expected
        replicas.update([ADDRESSES[0], ADDRESSES[2], ADDRESSES[3]])  # ADDRESSES[1] left
        left = _placement(replicas)
        assert all(left[key] == joined[key] for key in KEYS if joined[key] != ADDRESSES[1])
        replicas.update([])
        with pytest.raises(ServiceUnavailable, match="resolves to no address"):
            await replicas.propose(KEYS[0], None)
        await replicas.close()

    asyncio.run(scenario())


def test_a_copy_is_placed_with_its_source_and_so_is_a_copy_of_a_copy():
    replicas = _replicas(5)
    for key in KEYS[:100]:
        copy = copy_id(key)
        assert copy != key and route_key(copy) == key
        assert replicas.replica_for(copy) is replicas.replica_for(key) is replicas.replica_for(copy_id(copy))


def test_a_replica_that_does_not_answer_fails_the_call_as_a_cache_miss_then_takes_none():
    clock = _Clock()
    replicas = _replicas(2, failing={0}, clock=clock)
    key = next(key for key in KEYS if replicas.replica_for(key).address == ADDRESSES[0])
    first, second = (replica.client for replica in replicas.replicas)

    async def scenario():
        with pytest.raises(ServiceCacheMiss):  # the decoder re-syncs the whole prefix...
            await replicas.propose(key, None)
        assert await replicas.propose(key, None) == ADDRESSES[1]  # ...which goes to the other replica
        assert first.calls == 1 and replicas.moves == 1
        clock.now += 10  # after DOWN_S, the session's own replica is tried again
        first.fails = False
        assert await replicas.propose(key, None) == ADDRESSES[0]
        first.fails = second.fails = True
        with pytest.raises(ServiceCacheMiss):
            await replicas.propose(key, None)
        with pytest.raises(ServiceUnavailable):  # the last one: the service is down, as with one replica
            await replicas.propose(key, None)

    reader = InMemoryMetricReader()
    telemetry.install(None, MeterProvider([reader]))
    try:
        asyncio.run(scenario())
        points = [point for metric in reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics
                  if metric.name == "tandem.replica.failovers" for point in metric.data.data_points]
    finally:
        telemetry.install()
    assert [(dict(p.attributes), p.value) for p in points] == [({"service": "target"}, 2)]


def test_a_crowded_replica_takes_no_copies():
    replicas = _replicas(2)
    a, b = replicas.replicas
    on_a = [key for key in KEYS if replicas.replica_for(key) is a]
    on_b = [key for key in KEYS if replicas.replica_for(key) is b]
    for key in on_a[:2]:
        a.running[key] = 1
    assert not replicas.crowded(on_a[0]) and not replicas.crowded(on_b[0])  # 2 <= 2 * 0 + 2
    a.running[on_a[2]] = 2
    assert replicas.crowded(on_a[0]) and replicas.crowded(copy_id(on_a[0]))  # 3 > 2 * 0 + 2
    assert not replicas.crowded(on_b[0])
    b.running[on_b[0]] = 1
    assert not replicas.crowded(on_a[0])  # 3 <= 2 * 1 + 2


def test_a_session_counts_on_its_replica_while_its_call_runs():
    replicas = _replicas(2)
    key = KEYS[0]
    replica = replicas.replica_for(key)
    release = asyncio.Event()

    async def scenario():
        async def slow(client):
            await release.wait()
            return client.address

        calls = [asyncio.create_task(replicas._call(key, slow)) for _ in range(2)]
        copy_call = asyncio.create_task(replicas._call(copy_id(key), slow))
        await asyncio.sleep(0)
        assert replicas.active(replica) == 1 and replica.running == {key: 3}  # one session, three calls
        release.set()
        await asyncio.gather(*calls, copy_call)
        assert replicas.active(replica) == 0

    asyncio.run(scenario())


def test_new_sessions_are_placed_on_the_least_busy_replicas_of_both_services():
    clock = _Clock()
    targets, drafts = _replicas(2, clock=clock), _replicas(3, clock=clock, role="draft")  # (the same addresses)
    a, b = targets.replicas
    for key in KEYS[:2]:
        a.running[key] = 1  # two sessions running on target a
    drafts.replicas[0].running[KEYS[0]] = 1
    for _ in range(20):
        key = placed_id([targets, drafts])
        assert targets.replica_for(key) is b
        b.placed.clear()  # as if each had made its call and ended
        for replica in drafts.replicas:
            replica.placed.clear()
    # Sessions placed at once spread evenly: each counts on its replica until its first call.
    a.running.clear()
    drafts.replicas[0].running.clear()
    keys = [placed_id([targets, drafts]) for _ in range(6)]
    assert sorted(len(r.placed) for r in targets.replicas) == [3, 3]
    assert sorted(len(r.placed) for r in drafts.replicas) == [2, 2, 2]
    assert {targets.replica_for(key) for key in keys} == {a, b}

    async def first_call():
        await targets.propose(keys[0], None)

    asyncio.run(first_call())
    assert route_key(keys[0]) not in targets.replica_for(keys[0]).placed  # its calls count from now on
    clock.now += 10  # placed sessions that never called stop counting after PLACED_S
    assert [targets.active(r) for r in targets.replicas] == [0, 0]
    assert placed_id([]) == ""


def _board(role, stale_s=3 * LOAD_S):
    """A LoadBoard on the real Redis, under a role of this test's own (tests run side by side)."""
    import redis.asyncio

    return LoadBoard(redis.asyncio.Redis.from_url(REDIS_URL), role, stale_s)


def test_the_load_board_sums_the_other_orchestrators_fresh_entries():
    role = f"test-{uuid.uuid4().hex}"

    async def scenario():
        first, second, third = _board(role, 1.0), _board(role, 1.0), _board(role, 30.0)
        try:
            assert await first.share({"a:1": 2, "b:1": 0}) == {}
            assert await second.share({"a:1": 1, "b:1": 3}) == {"a:1": 2, "b:1": 0}
            assert await third.share({"b:1": 1}) == {"a:1": 3, "b:1": 3}
            assert await first.share({"a:1": 0, "b:1": 0}) == {"a:1": 1, "b:1": 4}  # its own is left out
            await asyncio.sleep(1.3)  # first's and second's entries are now stale (1 s): not counted, dropped
            assert await third.share({"b:1": 1}) == {}
            assert await third.redis.hkeys(third.key) == [third.id.encode()]
            await third.leave()
            assert not await third.redis.exists(third.key)
        finally:
            await first.redis.delete(first.key)
            for board in (first, second, third):
                await board.redis.aclose()

    asyncio.run(scenario())


def test_placement_counts_the_other_orchestrators_sessions_from_the_board():
    """Two orchestrators' target clients over the same replicas, sharing their
    loads through the board on the real Redis."""
    role = f"test-{uuid.uuid4().hex}"
    clock = _Clock()
    mine, theirs = (Replicas(_Client, role, ADDRESSES[:2], clock=clock) for _ in range(2))
    a, b = mine.replicas
    for key in KEYS[:4]:
        theirs.replicas[0].running[key] = 1  # the other orchestrator runs four sessions on a
    theirs.replicas[1].placed[KEYS[4]] = clock.now  # and has just placed one on b

    async def scenario():
        boards = [_board(role), _board(role)]
        mine.share_loads(boards[0])
        theirs.share_loads(boards[1])
        try:
            assert [mine.active(r) for r in mine.replicas] == [0, 0]  # nothing read yet: its own only
            await theirs.poll_loads()
            await mine.poll_loads()
            assert [mine.active(r) for r in mine.replicas] == [4, 1]
            keys = [placed_id([mine]) for _ in range(3)]  # on b, until it holds as many as a
            assert [mine.replica_for(key) for key in keys] == [b, b, b]
            assert [mine.active(r) for r in mine.replicas] == [4, 4]
            await mine.poll_loads()
            await theirs.poll_loads()  # and the other one sees them
            assert [theirs.active(r) for r in theirs.replicas] == [4, 1 + 3]
            clock.now += max(3 * LOAD_S, PLACED_S) + 0.5  # a reading older than 3 x load_s no longer counts
            assert [mine.active(r) for r in mine.replicas] == [0, 0]  # (own placements expired too)
        finally:
            await boards[0].redis.delete(boards[0].key)
            for board in boards:
                await board.redis.aclose()

    asyncio.run(scenario())


def test_orchestrators_placing_at_the_same_moment_take_different_replicas():
    """The board places (LoadBoard.place: one script, read and written at
    once): two orchestrators placing together never both take the idle one."""
    role = f"test-{uuid.uuid4().hex}"
    mine, theirs = (Replicas(_Client, role, ADDRESSES[:2]) for _ in range(2))

    async def scenario():
        boards = [_board(role), _board(role)]
        mine.share_loads(boards[0])
        theirs.share_loads(boards[1])
        try:
            picks = []
            for _ in range(10):
                ours, others = await asyncio.gather(mine.reserve(), theirs.reserve())
                picks.append((ours[0].address, others[0].address))
            return picks
        finally:
            await boards[0].redis.delete(boards[0].key)
            for board in boards:
                await board.redis.aclose()

    picks = asyncio.run(scenario())
    assert all(a != b for a, b in picks), picks


def test_one_orchestrators_sessions_placed_at_the_same_moment_spread_too():
    """Several requests reach one orchestrator at once: its placements run one
    at a time (placed_on_board), so each counts the one before; sent to the
    board together, each would carry the count from before any of them, and
    all three would take the replica that was idle."""
    role = f"test-{uuid.uuid4().hex}"
    mine, theirs = (Replicas(_Client, role, ADDRESSES[:2]) for _ in range(2))
    theirs.hold(KEYS[0])  # the other orchestrator runs one request
    busy = theirs.replica_for(KEYS[0]).address

    async def scenario():
        boards = [_board(role), _board(role)]
        mine.share_loads(boards[0])
        theirs.share_loads(boards[1])
        lock = asyncio.Lock()
        try:
            await theirs.poll_loads()
            keys = await asyncio.gather(*(placed_on_board([mine], lock) for _ in range(3)))
            return [mine.replica_for(key).address for key in keys]
        finally:
            await boards[0].redis.delete(boards[0].key)
            for board in boards:
                await board.redis.aclose()

    placed = asyncio.run(scenario()) + [busy]
    assert sorted(placed.count(address) for address in ADDRESSES[:2]) == [2, 2], placed
    assert placed_id([]) == "" and asyncio.run(placed_on_board([], asyncio.Lock())) == ""


def test_without_redis_a_placement_falls_back_to_the_last_reading_at_once():
    import time

    import redis.asyncio

    targets = Replicas(_Client, "target", ADDRESSES[:2])
    targets.replicas[0].running[KEYS[0]] = 1

    async def scenario():
        client = redis.asyncio.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=5)
        targets.share_loads(LoadBoard(client, "target", 3 * LOAD_S))
        try:
            started = time.monotonic()
            reserved = await targets.reserve()
            return reserved, time.monotonic() - started, placed_id([targets], [reserved])
        finally:
            await client.aclose()

    reserved, took_s, key = asyncio.run(scenario())
    assert reserved is None and took_s <= 1.0
    assert targets.replica_for(key) is targets.replicas[1]  # least_busy: its own count


def test_a_request_counts_on_its_replica_from_start_to_end_and_follows_a_move():
    clock = _Clock()
    targets = Replicas(_Client, "target", ADDRESSES[:2], clock=clock)
    drafts = Replicas(_Client, "draft", ADDRESSES[:2], clock=clock)
    key = placed_id([targets, drafts])
    home = targets.replica_for(key)
    assert targets.own(home) == 1  # placed
    unhold = hold([targets, drafts, object()], key)  # a plain client has nothing to count
    assert route_key(key) not in home.placed and home.held == {route_key(key): 1}
    assert [targets.own(r) for r in targets.replicas].count(1) == 1
    clock.now += 10  # no call for a while (the draft works): it still counts
    assert targets.own(home) == 1
    other = next(r for r in targets.replicas if r is not home)
    home.down_until = clock.now + 5  # set aside: the session's next call goes to the other one

    async def call():
        await targets.propose(key, None)

    asyncio.run(call())
    assert targets.own(home) == 0 and other.held == {route_key(key): 1}
    unhold()
    assert [targets.own(r) for r in targets.replicas] == [0, 0]
    assert [drafts.own(r) for r in drafts.replicas] == [0, 0]


def test_each_replicas_sessions_are_metrics_this_orchestrators_and_every_ones():
    role = f"test-{uuid.uuid4().hex}"
    clock = _Clock()
    targets = Replicas(_Client, role, ADDRESSES[:2], clock=clock)
    a, b = targets.replicas
    a.running[KEYS[0]] = 2  # one session, two calls in flight
    b.placed[KEYS[1]] = clock.now
    b.others, b.others_at = 3, clock.now  # the other orchestrators' three, just read from the board
    reader = InMemoryMetricReader()
    telemetry.install(None, MeterProvider([reader]))
    try:
        metrics = reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics
    finally:
        telemetry.install()
    found = {(metric.name, point.attributes["replica"]): point.value for metric in metrics
             if metric.name.startswith("tandem.replica.") for point in metric.data.data_points
             if point.attributes.get("service") == role}
    assert found == {("tandem.replica.sessions", a.address): 1, ("tandem.replica.sessions", b.address): 1,
                     ("tandem.replica.load", a.address): 1, ("tandem.replica.load", b.address): 4}


@pytest.mark.parametrize("fields, words", [
    (dict(target_address="a:1,,b:2"), "an empty address"),
    (dict(draft_address="a:1,a:1"), "an address given twice"),
    (dict(target_address="a:1,b:2", relay=True), "--relay on"),
    (dict(target_address="dns:///tandem-target:50052", relay=True), "--relay on"),
    (dict(target_address="dns:///tandem-target"), "dns:///NAME:PORT"),
    (dict(draft_address="dns:///a:1,b:2"), "dns:///NAME:PORT"),
    (dict(target_address="a:1,b:2", replica_load_s=-1.0), "--replica-load-interval"),
    (dict(target_address="a:1,b:2", replica_load_s=float("nan")), "--replica-load-interval"),
])
def test_bad_replica_lists_are_refused(fields, words):
    with pytest.raises(ValueError, match=words):
        OrchestratorConfig(**{"draft_address": "d:1", "target_address": "t:1", **fields})


# --- end to end: real services, real gRPC, real Redis ---------------------------
@pytest.fixture(scope="module")
def replica_cluster(tiny_models, near_draft):
    cluster = Cluster(tiny_models["target"], near_draft, target_replicas=2, draft_replicas=2, relay=False)
    yield cluster
    cluster.stop()


def _holders(servicers, session_id, tenant="default"):
    """The replicas that hold the session's caches, under its cache id (placed_id's)."""
    import redis

    with redis.Redis.from_url(REDIS_URL) as store:
        cache_id = (store.hget(f"tandem:{tenant}:session:{session_id}", "cache_id") or session_id.encode()).decode()
    return [i for i, servicer in enumerate(servicers) if cache_id in servicer.store]


def test_sessions_spread_over_both_replicas_and_every_output_equals_the_target_alone(replica_cluster, tiny_models):
    prompts = [[(7 * i + 3 * j) % 120 + 1 for j in range(9)] for i in range(16)]
    calls_before = [s.calls for s in replica_cluster.targets + replica_cluster.drafts]
    with replica_cluster.client() as client:
        results = [client.generate(prompt_ids=prompt, max_tokens=12) for prompt in prompts]
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference_greedy(tiny_models["target"], prompt, 12)
        assert result.stats.cache_misses == 0 and result.stats.undrafted_rounds == 0
    calls = [s.calls - before for s, before in zip(replica_cluster.targets + replica_cluster.drafts, calls_before)]
    assert all(calls), calls  # 16 sessions: all on one replica by chance once in 2**15


def test_a_session_keeps_its_replicas_from_turn_to_turn(replica_cluster, tiny_models):
    with replica_cluster.client() as client:
        session = client.create_session()
        first = client.chat(session, message_ids=[11, 22, 33, 44, 55, 66, 77], max_tokens=10)
        second = client.chat(session, message_ids=[5, 6, 7, 8], max_tokens=10)
        assert len(_holders(replica_cluster.targets, session)) == len(_holders(replica_cluster.drafts, session)) == 1
        client.delete_session(session)
    assert second.stats.cache_misses == 0
    assert second.stats.target_prefill_tokens <= 4 + second.stats.rounds  # the new turn, not the history
    history = [11, 22, 33, 44, 55, 66, 77] + first.token_ids + [5, 6, 7, 8]
    assert second.token_ids == reference_greedy(tiny_models["target"], history, 10)


def test_a_copy_of_a_parked_prompt_is_made_on_its_replicas(replica_cluster, tiny_models):
    own = [(19 * i + 7) % 120 + 1 for i in range(40)]
    shared = own[:36] + [9, 8, 7, 6, 5, 4, 3, 2, 1, 10] * 5  # less than half the parked tokens: a copy
    forks_before = sum(s.store.counters.forks for s in replica_cluster.targets)
    with replica_cluster.client() as client:
        client.generate(prompt_ids=own, max_tokens=60)  # parked: 100 tokens, of which 36 in common
        copied = client.generate(prompt_ids=shared, max_tokens=10)
    assert copied.cached_prompt_tokens == 36 and copied.stats.cache_misses == 0
    assert copied.token_ids == reference_greedy(tiny_models["target"], shared, 10)
    assert sum(s.store.counters.forks for s in replica_cluster.targets) == forks_before + 1


def test_replicas_of_different_models_are_refused(replica_cluster, tiny_models):
    from orchestrator.server import OrchestratorServicer, PairingError
    from target_service.server import build_server as build_target
    from tests.conftest import DEVICE, CacheConfig, ModelConfig

    async def connect():
        other, port, _, _ = build_target("127.0.0.1:0", ModelConfig(tiny_models["other"], device=DEVICE,
                                                                    dtype="float32"), CacheConfig())
        await other.start()
        first_target = replica_cluster.target_address.split(",")[0]
        servicer = OrchestratorServicer(OrchestratorConfig(draft_address=replica_cluster.draft_address,
                                                           target_address=f"{first_target},127.0.0.1:{port}"))
        try:
            await servicer.connect()
        finally:
            await servicer.close()
            await other.stop(0)

    with pytest.raises(PairingError, match="the target replicas serve different models") as err:
        replica_cluster.run(connect())
    assert tiny_models["other"] in str(err.value) and tiny_models["target"] in str(err.value)


def test_a_replica_that_goes_down_hands_its_sessions_over_and_nothing_changes(tiny_models, near_draft):
    cluster = Cluster(tiny_models["target"], near_draft, target_replicas=2, draft_replicas=2, relay=False)
    turn1, turn2 = [11, 22, 33, 44, 55, 66, 77], [5, 6, 7, 8]
    try:
        with cluster.client() as client:
            sessions = [client.create_session() for _ in range(6)]
            firsts = [client.chat(session, message_ids=turn1, max_tokens=8) for session in sessions]
            # The target replica and the draft replica of the first session go down.
            target, = _holders(cluster.targets, sessions[0])
            draft, = _holders(cluster.drafts, sessions[0])
            cluster.run(cluster.target_servers[target].stop(0))
            cluster.run(cluster.draft_servers[draft].stop(0))
            seconds = [client.chat(session, message_ids=turn2, max_tokens=8) for session in sessions]
            for session, first, second in zip(sessions, firsts, seconds):
                history = turn1 + first.token_ids + turn2
                assert second.token_ids == reference_greedy(tiny_models["target"], history, 8)
                assert second.stats.undrafted_rounds == 0  # drafted by the other draft replica
                assert 1 - target in _holders(cluster.targets, session)  # (the stopped one's store is still there)
            assert seconds[0].stats.cache_misses >= 2  # one per service: each moved and re-synced
            # Stateless requests go on too, whichever replica they would have had.
            for i in range(6):
                prompt = [(5 * i + j) % 120 + 1 for j in range(8)]
                assert client.generate(prompt_ids=prompt, max_tokens=6).token_ids == reference_greedy(
                    tiny_models["target"], prompt, 6)
            # With no target replica left, a request fails as with one target down.
            cluster.run(cluster.target_servers[1 - target].stop(0))
            with pytest.raises(grpc.RpcError) as err:
                client.generate(prompt_ids=turn1, max_tokens=4)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        cluster.stop()


def test_each_replica_reports_its_own_stats(replica_cluster):
    from orchestrator.backends import GrpcVerifier

    async def stats():
        replicas = Replicas(GrpcVerifier, "target", replica_cluster.target_address.split(","))
        try:
            return await replicas.stats()
        finally:
            await replicas.close()

    found = replica_cluster.run(stats())
    assert len(found) == 2 and all(isinstance(s, common_pb2.ServiceStats) for s in found)


async def _info():
    return common_pb2.ModelInfo(model_id="m", vocab_size=10, max_context=64)


@pytest.mark.parametrize("load_s", [LOAD_S, 0])
def test_pairing_starts_sharing_the_loads_unless_the_interval_is_0(load_s):
    role = f"test-{uuid.uuid4().hex}"
    targets = Replicas(_Client, role, ADDRESSES[:2], load_s=load_s)
    targets.replicas[0].running[KEYS[0]] = 1
    for replica in targets.replicas:
        replica.client.model_info = _info

    async def scenario():
        board = _board(role)
        targets.share_loads(board)
        try:
            await targets.model_info()
            await asyncio.sleep(0.2)
            shared = await board.redis.hget(board.key, board.id)
            await targets.close()  # leaves the board
            return shared, await board.redis.hget(board.key, board.id)
        finally:
            await board.redis.aclose()

    shared, after_close = asyncio.run(scenario())
    if load_s:
        assert shared.decode().endswith(f' {{"{ADDRESSES[0]}": 1, "{ADDRESSES[1]}": 0}}') and after_close is None
    else:
        assert shared is None


def test_a_second_orchestrator_places_beside_the_sessions_the_first_runs(replica_cluster, tiny_models):
    """The cluster's orchestrator runs three requests, held on the targets'
    model threads; a second orchestrator's target client (its own class, on
    its own board entry) reads them from Redis and places a new session on
    the less busy replica. Released, every output equals the target alone."""
    import threading
    import time

    from orchestrator.backends import GrpcVerifier

    first = replica_cluster.orchestrator.verifier
    release = threading.Event()
    held = [target.worker.submit(release.wait, 60) for target in replica_cluster.targets]
    prompts = [[(5 * i + 3 * j) % 120 + 1 for j in range(9)] for i in range(3)]
    results = [None] * 3

    def send(i):
        with replica_cluster.client() as client:
            results[i] = client.generate(prompt_ids=prompts[i], max_tokens=8)

    senders = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    try:
        for sender in senders:
            sender.start()
        deadline = time.monotonic() + 30
        while sum(len(r.running) for r in first.replicas) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        running = [len(r.running) for r in first.replicas]
        assert sum(running) == 3, running  # every request waits on a target, its prefill in flight
        assert [len(r.held) for r in first.replicas] == running  # and each counts there until it ends
        time.sleep(2 * LOAD_S)  # the first orchestrator has shared them since

        async def second_orchestrator():
            import redis.asyncio

            other = Replicas(GrpcVerifier, "target", replica_cluster.target_address.split(","))
            client = redis.asyncio.Redis.from_url(REDIS_URL)
            other.share_loads(LoadBoard(client, "target", 3 * LOAD_S))
            try:
                before = [other.active(r) for r in other.replicas]
                await other.poll_loads()
                return before, [other.active(r) for r in other.replicas], other.replica_for(placed_id([other]))
            finally:
                await other.close()
                await client.aclose()

        before, after, placed = replica_cluster.run(second_orchestrator())
    finally:
        release.set()
        for job in held:
            job.result(10)
        for sender in senders:
            sender.join(60)
    assert before == [0, 0] and after == running
    assert [first.own(r) for r in first.replicas] == [0, 0]  # the requests ended: none counts
    assert placed.address == replica_cluster.target_address.split(",")[running.index(min(running))]
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference_greedy(tiny_models["target"], prompt, 8)


def test_a_dns_name_of_replicas_is_looked_up_and_served(replica_cluster, tiny_models):
    """dns:///localhost:PORT: the replicas are the addresses the name resolves
    to (127.0.0.1, and ::1 where the hosts file has it, where nothing listens:
    a replica that does not answer, whose sessions go to the other)."""
    from orchestrator.server import build_server
    from tandem.client import TandemClient

    port = replica_cluster.target_address.split(",")[0].rpartition(":")[2]
    config = OrchestratorConfig(draft_address=replica_cluster.draft_address,
                                target_address=f"dns:///localhost:{port}")

    async def start():
        server, orch_port, _, servicer = build_server("127.0.0.1:0", config)
        await server.start()
        return server, orch_port, servicer

    server, orch_port, servicer = replica_cluster.run(start())
    try:
        with TandemClient(f"127.0.0.1:{orch_port}", timeout_s=120) as client:
            for i in range(6):
                prompt = [(11 * i + j) % 120 + 1 for j in range(8)]
                assert client.generate(prompt_ids=prompt, max_tokens=8).token_ids == reference_greedy(
                    tiny_models["target"], prompt, 8)
        assert "127.0.0.1:" + port in [r.address for r in servicer.verifier.replicas]  # looked up at pairing
    finally:
        replica_cluster.run(server.stop(0))
        replica_cluster.run(servicer.close())


def test_the_replica_probe_spreads_sessions_over_both_targets_with_the_same_replies(char_models, tmp_path):
    """bench.replica_probe on the tiny pair: real processes, two orchestrators
    in front of the same services, one given one target and one given two."""
    import json

    from bench.replica_probe import main

    out = tmp_path / "replica_probe.json"
    assert main(["--target", char_models["target"], "--draft", char_models["draft"], "--draft-args", "", "--dtype", "float32",
                 "--clients", "2", "--reps", "1", "--repeat", "4", "--new-tokens", "8", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["identical_rounds"] == result["rounds"] == 1
    two, one = result["modes"]["two_targets"]["2"], result["modes"]["one_target"]["2"]
    assert all(two["target_calls"]), two  # 16 sessions: all on one target by chance once in 2**15
    assert one["target_calls"][0] > 0 and one["target_calls"][1] == 0


def test_the_replica_probe_compares_orchestrators_that_share_their_loads_with_ones_that_do_not(char_models, tmp_path):
    """bench.replica_probe --compare load on the tiny pair: two pairs of
    orchestrator processes over the same two targets, the clients taking turns
    over a pair's two; the replies are the same on both sides."""
    import json

    from bench.replica_probe import main

    out = tmp_path / "replica_load_probe.json"
    assert main(["--target", char_models["target"], "--draft", char_models["draft"], "--draft-args", "", "--dtype", "float32",
                 "--compare", "load", "--clients", "2", "--reps", "1", "--repeat", "4", "--new-tokens", "8",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["compare"] == "load" and result["orchestrators_per_side"] == 2
    assert result["identical_rounds"] == result["rounds"] == 1 and result["reference"] == "own_loads"
    for side in ("shared_loads", "own_loads"):
        mode = result["modes"][side]["2"]
        assert sum(mode["target_calls"]) > 0 and 0.5 <= mode["busier_share_mean"] <= 1.0
        (run,) = result["runs"][side]["2"]
        assert run["samples"] > 0 and run["sample_errors"] == 0  # the orchestrators' gauges were scraped
