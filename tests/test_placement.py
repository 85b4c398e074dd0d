"""--prefill-overlap auto: the services report where they compute, and the
orchestrator runs a turn's two prefills at once only where they do not
share a machine's cores."""
import os

import pytest
import torch

from orchestrator.generation import EngineConfig, Generation
from orchestrator.request_params import RequestParams
from tandem import placement
from tandem.sampling import SamplingParams
from tandem.v1 import common_pb2
from tests.conftest import Cluster, reference_greedy

HOST = "2f0c7a1e-0000-4000-8000-000000000001"


def _info(cpus, threads, host=HOST, device="cpu", backend="model"):
    return common_pb2.ModelInfo(host_id=host, cpus=cpus, threads=threads, device=device, backend=backend)


@pytest.mark.parametrize("draft, target, shared", [
    (_info([0], 1), _info([1], 1), False),  # pinned one core each, as bench-nodes' (b)-(d)
    (_info([0, 1], 1), _info([0, 1], 1), False),  # unpinned, one thread each: two threads, two CPUs
    (_info([0, 1], 2), _info([0, 1], 2), True),  # unpinned, two threads each: (g) sequential 2/2
    (_info([0, 1], 2), _info([2, 3], 2), False),  # two cores each of one machine
    (_info([0, 1], 2), _info([1, 2], 2), True),  # overlapping sets: 4 threads on 3 CPUs
    (_info([0, 1], 2), _info([0, 1], 2, host="other-machine"), False),  # two nodes
    (_info([0, 1], 2), _info([0, 1], 2, device="cuda:0"), False),  # the target on a GPU
    (_info([0, 1], 2, backend="ngram"), _info([0, 1], 2), False),  # a model-free draft's prefill costs nothing
    (_info([0, 1], 2, host=""), _info([0, 1], 2, host=""), False),  # no boot id: unknown, overlap
    (common_pb2.ModelInfo(device="cpu"), _info([0, 1], 2), False),  # an older draft service reports nothing
])
def test_shared_cores(draft, target, shared):
    reason = placement.shared_cores(draft, target)
    assert (reason is not None) == shared
    if shared:
        assert "share a machine's" in reason


@pytest.mark.parametrize("configured, shared, seeded_sampled, overlap", [
    (None, False, False, True),
    (None, True, False, False),
    (None, True, True, True),  # a seed's tokens must not depend on where the services run
    (True, True, False, True),  # on and off are obeyed whatever the placement
    (False, False, False, False),
    (False, True, True, False),
])
def test_the_overlap_a_request_gets(configured, shared, seeded_sampled, overlap):
    generation = Generation(None, None, None, None, set(), EngineConfig(prefill_overlap=configured))
    generation.cores_shared = "the draft and the target share a machine's 2 CPUs" if shared else None
    sampling = SamplingParams(temperature=0.8, seed=7) if seeded_sampled else SamplingParams()
    assert generation.prefill_overlap(RequestParams(sampling, seeded=seeded_sampled)) is overlap


def test_a_service_reports_where_it_computes(same_cluster):
    """Over real gRPC: the boot id, the process's CPUs and its torch threads."""
    with open(placement.BOOT_ID) as f:
        boot_id = f.read().strip()
    with same_cluster.client() as client:
        client.server_info()  # the orchestrator pairs the services on its first request
    for info in (same_cluster.orchestrator.target_info, same_cluster.orchestrator.draft_info):
        assert info.host_id == boot_id
        assert list(info.cpus) == sorted(os.sched_getaffinity(0))
        assert info.threads == torch.get_num_threads()


@pytest.fixture
def threads_per_cpu():
    """torch threads = the CPUs this process may use: the in-process services
    then have twice as many threads as CPUs between them."""
    before = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("configured", [None, True])
def test_auto_turns_the_overlap_off_where_the_services_share_cores(tiny_models, threads_per_cpu, configured):
    """Both in-process services on this process's CPUs: under auto a turn's
    draft prefills and drafts before the target's prefill (every round drafts),
    and the output is the target's; --prefill-overlap on still overlaps (the
    first round decodes on the target alone)."""
    cluster = Cluster(tiny_models["target"], tiny_models["target"], pipeline=False, prefill_overlap=configured)
    prompt = [5, 3, 5, 8, 9, 7, 9]
    try:
        with cluster.client() as client:
            overlap = client.server_info().prefill_overlap
            result = client.generate(prompt_ids=prompt, max_tokens=12)
    finally:
        cluster.stop()
    assert overlap is (configured is True)
    assert result.token_ids == reference_greedy(tiny_models["target"], prompt, 12)
    stats = result.stats
    # Every round that drafted tried position 0. The last round may draft nothing: it wants one token.
    assert stats.tried_per_position[0] == stats.rounds - stats.rounds_per_k[0]
    assert stats.rounds_per_k[0] - (1 if overlap else 0) <= 1


def test_pipeline_auto_times_both_modes_then_takes_the_faster(tiny_models):
    """--pipeline auto over real gRPC: the first request pre-drafts, the second
    does not, and each later one takes the mode the measured costs favour
    (ServerInfo says which); a request's own pipeline field wins. Every
    output is the target alone's."""
    cluster = Cluster(tiny_models["target"], tiny_models["target"], pipeline=None)
    prompt = [2, 7, 1, 8, 2, 8]
    expected = reference_greedy(tiny_models["target"], prompt, 10)
    try:
        with cluster.client() as client:
            assert client.server_info().pipeline_auto
            modes, preferred_before = [], []
            for _ in range(3):
                preferred_before.append(cluster.orchestrator.generation.pipeline_choice.preferred())
                result = client.generate(prompt_ids=prompt, max_tokens=10)
                assert result.token_ids == expected
                modes.append(result.stats.pipelined)
                assert (result.stats.predraft_attempts > 0) is result.stats.pipelined
            preferred = cluster.orchestrator.generation.pipeline_choice.preferred()
            assert client.server_info().pipeline is preferred
            forced = client.generate(prompt_ids=prompt, max_tokens=10, pipeline=not preferred)
            assert forced.stats.pipelined is (not preferred) and forced.token_ids == expected
    finally:
        cluster.stop()
    assert modes[:2] == [True, False]
    assert modes[2] is preferred_before[2]  # the 3rd of every 8 does not explore
