"""Adaptive draft length: bounds and direction on synthetic measurements."""
import pytest

from orchestrator.policy import KPolicy, KPolicyConfig, PipelineChoice, StepCosts, expected_tokens_per_round


def test_leviathan_tau():
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.8, 3) == pytest.approx((1 - 0.8**4) / 0.2)


def _run(policy, alpha_accepts, rounds=30, draft_ms=20.0, verify_ms=100.0):
    """Rounds as the decoder runs them: pipelined, a block follows a fully
    accepted one pre-drafted (k_ahead long), else freshly drafted (k long).
    Returns the length the last kind of round would use next."""
    ahead = False
    for _ in range(rounds):
        k = policy.k_ahead if ahead else policy.k
        accepted = k if alpha_accepts else 0
        policy.observe(k, accepted, draft_ms, verify_ms)
        ahead = policy.pipelined and accepted == k
    return policy.k_ahead if ahead else policy.k


@pytest.mark.parametrize("pipelined", [False, True])
def test_k_grows_with_acceptance_and_shrinks_without(pipelined):
    config = KPolicyConfig(k=3, k_min=1, k_max=7)
    assert _run(KPolicy(config, pipelined), alpha_accepts=True, draft_ms=5.0) == 7
    assert _run(KPolicy(config, pipelined), alpha_accepts=False) == 1


def test_k_stays_in_bounds_and_follows_cost():
    config = KPolicyConfig(k=4, k_min=2, k_max=6)
    cheap = KPolicy(config, pipelined=False)
    costly = KPolicy(config, pipelined=False)
    for _ in range(30):
        cheap.observe(cheap.k, int(cheap.k * 0.8), 5.0, 100.0)
        costly.observe(costly.k, int(costly.k * 0.8), 60.0, 100.0)
    assert 2 <= costly.k <= cheap.k <= 6
    assert costly.k < cheap.k


def test_fixed_k_never_moves():
    policy = KPolicy(KPolicyConfig(k=3, adaptive=False), pipelined=True)
    assert _run(policy, alpha_accepts=True) == 3


def test_config_checks_itself():
    with pytest.raises(ValueError):
        KPolicyConfig(k=9, k_max=8)
    KPolicyConfig(k=4, k_max=63)
    with pytest.raises(ValueError, match="k_max <= 63"):  # a pre-draft of k_max + 1 tokens would be refused
        KPolicyConfig(k=4, k_max=64)


def test_pipelined_k_stops_where_the_draft_outlasts_the_verify():
    """All accepted, draft step 20 ms, verify 100 ms: beyond k = 4 the pre-draft of
    k + 1 tokens outlasts the verify, so a longer block buys nothing."""
    policy = KPolicy(KPolicyConfig(k=2, k_min=1, k_max=8), pipelined=True)
    assert _run(policy, alpha_accepts=True, draft_ms=20.0, verify_ms=100.0) == 4


def test_k_shrinks_when_each_verified_token_costs_almost_a_decode():
    """A CPU without native bf16: verify(k+1) ≈ 440 + 300·k ms. Even at high
    acceptance a long block does not pay, and the policy must learn the slope."""
    policy = KPolicy(KPolicyConfig(k=4, k_min=1, k_max=8), pipelined=False)
    for _ in range(40):
        k = policy.k
        accepted = k if _ % 5 else k - 1  # α ≈ 0.8
        policy.observe(k, accepted, 50.0, 440.0 + 300.0 * k)
    assert policy.k <= 2
    flat = KPolicy(KPolicyConfig(k=4, k_min=1, k_max=8), pipelined=False)
    for _ in range(40):
        k = flat.k
        flat.observe(k, k if _ % 5 else k - 1, 50.0, 440.0)  # a GPU: verify cost flat in k
    assert flat.k > policy.k


def test_k_follows_a_step_shaped_verify_cost():
    """Packed float32 kernels on a CPU: verifying 1-2 tokens costs the same,
    4-9 tokens about 1.5x that. From k = 1 the policy must find the long blocks
    that pay, by trying an unseen length once and keeping what it measured."""
    cost = {2: 520.0, 3: 650.0, 4: 780.0, 5: 790.0, 6: 800.0, 7: 805.0, 8: 808.0, 9: 810.0}
    policy = KPolicy(KPolicyConfig(k=1, k_min=1, k_max=8), pipelined=False)
    tried = set()
    for i in range(60):
        k = policy.k
        tried.add(k)
        policy.observe(k, k if i % 8 else k - 1, 60.0, cost[k + 1])
    assert policy.k >= 5
    assert len(tried) <= 5  # it explores a few lengths, not all of them


def test_alpha_is_the_acceptance_rate_not_a_mean_of_round_ratios():
    """Rounds of k = 4 draws with per-token acceptance 0.8: the estimate must
    centre on 0.8 (a mean of per-round accepted/tried centres near 0.65)."""
    import random

    rng = random.Random(7)
    policy = KPolicy(KPolicyConfig(k=4, adaptive=False, ema=0.05), pipelined=True)
    seen = []
    for i in range(600):
        accepted = 0
        while accepted < 4 and rng.random() < 0.8:
            accepted += 1
        policy.observe(4, accepted, 20.0, 100.0)
        if i >= 100:
            seen.append(policy.alpha)
    assert sum(seen) / len(seen) == pytest.approx(0.8, abs=0.03)


def test_step_costs_are_shared_between_sessions():
    from orchestrator.policy import StepCosts

    costs = StepCosts(0.3)
    first = KPolicy(KPolicyConfig(k=3, k_min=1, k_max=8), pipelined=False, costs=costs)
    for _ in range(10):
        first.observe(first.k, first.k, 50.0, 400.0)
    second = KPolicy(KPolicyConfig(k=3, k_min=1, k_max=8), pipelined=False, costs=costs)
    assert second.draft_step_ms == pytest.approx(50.0)
    assert second.verify_cost(first.k + 1) == pytest.approx(400.0)
    second.observe(3, 3, 50.0, 400.0)  # its first round already uses what the first learned
    assert second.k == first.k


def test_pipelined_drafts_short_on_the_critical_path_and_long_beside_a_verify():
    """α ≈ 0.8, verify flat at 350 ms, draft step 33 ms (the default pair on a
    bf16 CPU core): after a miss the fresh draft waits on the critical path, a
    pre-draft hides behind the verify, so the fresh block is the shorter one."""
    import random

    rng = random.Random(3)
    policy = KPolicy(KPolicyConfig(k=3, k_min=1, k_max=8, ema=0.05), pipelined=True)
    ahead = False
    for _ in range(400):
        k = policy.k_ahead if ahead else policy.k
        accepted = 0
        while accepted < k and rng.random() < 0.8:
            accepted += 1
        policy.observe(k, accepted, 33.0, 350.0)
        ahead = accepted == k and rng.random() < 0.8  # the bonus guess holds too
    assert 1 <= policy.k < policy.k_ahead <= 8
    sequential = KPolicy(KPolicyConfig(k=3, k_min=1, k_max=8), pipelined=False)
    assert sequential.k == sequential.k_ahead


def _costs(step_ms: float, verify_4_ms: float, slope_ms: float) -> StepCosts:
    """A draft step and verifies of 2..7 tokens, verify_4_ms at 4 tokens."""
    costs = StepCosts(1.0)
    for tokens in range(2, 8):
        costs.observe(tokens, step_ms, verify_4_ms + slope_ms * (tokens - 4))
    return costs


# Measured in make bench-nodes (bench/RESULTS.md): sequential (b) and pipelined
# (c) k=3 on the same prompts, a draft step and a verify of 3+1 tokens, ms.
ZEN4 = dict(sequential=(10.9, 149.2), pipelined=(12.8, 168.3))  # (c) k=3 ran 0.973x (b)
AMX = dict(sequential=(34.8, 515.0), pipelined=(35.2, 538.8))  # (c) k=3 ran 1.034x (b)


@pytest.mark.parametrize("machine, pipelined", [(ZEN4, False), (AMX, True)])
def test_auto_pipelines_where_the_pre_draft_hides_more_than_the_verify_loses(machine, pipelined):
    """h·k·s against V_beside − V_alone: on the Zen 4 VM a draft step is 0.073
    of a verify and the verify beside a draft 12.8% slower, so sequential
    wins; on the AMX VM the verify is 4.6% slower and pipelining wins."""
    costs = {False: _costs(*machine["sequential"], 6.0), True: _costs(*machine["pipelined"], 7.0)}
    choice = PipelineChoice(KPolicyConfig(k=3, k_min=1, k_max=6), costs)
    choice.observe(accepted=75, rejected_rounds=25)
    assert choice.alpha == pytest.approx(0.75)
    assert choice.preferred() is pipelined
    assert (choice.expected_rate(True) > choice.expected_rate(False)) is pipelined


def test_auto_compares_the_modes_at_the_lengths_both_have_timed():
    """Sequential timed at 3+1 tokens only, pipelined at 2..7 tokens: at k = 3
    the pre-draft wins (2.73 tokens per 184.6 ms against 198 ms), but the flat
    and proportional guesses for lengths sequential never ran (a verify of 1+1
    tokens guessed at 82.5 ms, measured 100 pipelined) would make it look the
    faster."""
    pipelined, sequential = StepCosts(1.0), StepCosts(1.0)
    for tokens, verify_ms in {2: 100.0, 3: 130.0, 4: 160.0, 5: 190.0, 6: 220.0, 7: 250.0}.items():
        pipelined.observe(tokens, 12.0, verify_ms)
    sequential.observe(4, 11.0, 165.0)
    choice = PipelineChoice(KPolicyConfig(k=3, k_min=1, k_max=6), {True: pipelined, False: sequential})
    choice.observe(accepted=75, rejected_rounds=25)
    assert choice.common_ks() == [3]
    assert choice.expected_rate(False) > choice.expected_rate(True)  # over all lengths, guesses included
    assert choice.expected_rate(True, [3]) > choice.expected_rate(False, [3])
    assert choice.preferred() is True
    sequential.observe(8, 11.0, 300.0)  # k = 7 is beyond k_max: not a common length
    pipelined.observe(8, 12.0, 280.0)
    assert choice.common_ks() == [3]
    choice = PipelineChoice(KPolicyConfig(k=3, k_min=1, k_max=6), {True: pipelined, False: StepCosts(1.0)})
    assert choice.common_ks() is None


def test_auto_times_each_mode_first_then_explores_the_other_every_nth_request():
    costs = {False: StepCosts(1.0), True: StepCosts(1.0)}
    choice = PipelineChoice(KPolicyConfig(k=3, k_min=1, k_max=6), costs, explore_every=4)
    assert choice.choose() is True  # nothing timed: pipelined first
    costs[True].observe(4, *AMX["pipelined"])
    choice.observe(accepted=8, rejected_rounds=2)
    assert choice.choose() is False  # then sequential, still untimed
    costs[False].observe(4, *AMX["sequential"])
    # Both timed, pipelining expected faster: the 4th request of every 4 explores.
    assert [choice.choose() for _ in range(8)] == [True, False, True, True, True, False, True, True]


def test_auto_follows_the_costs_as_they_change():
    costs = {False: _costs(*AMX["sequential"], 6.0), True: _costs(*AMX["pipelined"], 7.0)}
    choice = PipelineChoice(KPolicyConfig(k=3, k_min=1, k_max=6, ema=0.5), costs)
    choice.observe(accepted=75, rejected_rounds=25)
    assert choice.preferred() is True
    for _ in range(6):  # the machine gets busy: a verify beside a pre-draft now costs 40% more
        for tokens in range(2, 8):
            costs[True].observe(tokens, 35.2, 1.4 * (515.0 + 6.0 * (tokens - 4)))
    assert choice.preferred() is False


def test_auto_checks_its_exploration_period():
    with pytest.raises(ValueError, match="explore_every"):
        PipelineChoice(KPolicyConfig(), {False: StepCosts(0.3), True: StepCosts(0.3)}, explore_every=1)
