"""The benchmarks' settings (bench/nodes.py, common.py, hf_baselines.py): what (g) runs, and how (f) runs."""
import argparse
from pathlib import Path

import pytest

from bench.nodes import WHOLE_CONFIGS, target_linear, whole_configs


def test_whole_configs_give_each_service_its_threads():
    assert whole_configs("sequential:2, pipelined:2/1,sequential:3/1") == [(False, 2, 2), (True, 2, 1), (False, 3, 1)]


def test_the_default_whole_configs_parse():
    configs = whole_configs(WHOLE_CONFIGS)  # argparse parses the default on every run, --help included
    assert configs and all(target >= 1 and draft >= 1 for _, target, draft in configs)


@pytest.mark.parametrize("spec", ["sequential", "pipelined:0", "pipelined:2/0", "pipelined:2/", "greedy:2", "sequential:a/1"])
def test_bad_whole_configs_are_refused(spec):
    with pytest.raises(argparse.ArgumentTypeError, match="--whole-configs"):
        whole_configs(spec)


def test_the_target_alone_is_timed_first_in_the_target_services_kernels():
    assert target_linear("") == "auto"
    assert target_linear("--linear bf16w") == "bf16w"
    assert target_linear("--cache-budget-mb 100 --linear=native --foo") == "native"


def test_hf_assisted_runs_as_configured_and_keeps_the_target_output(tiny_models):
    """Mode (f), the baseline (g) is measured against: HF assisted generation
    with the settings the JSON records (not transformers' moving defaults),
    greedy, so its tokens are the target alone's."""
    from bench.hf_baselines import hf_assisted_config, hf_generate, load_hf

    target = load_hf(tiny_models["target"], "float32")
    assistant = load_hf(tiny_models["other"], "float32")
    prompts = {"a": [5, 9, 17, 3], "b": [40, 2, 2, 7, 99, 11]}
    alone = hf_generate(target, prompts, 24)
    assisted = hf_generate(target, prompts, 24, assistant=assistant, k=3)
    for name, value in hf_assisted_config(3).items():
        assert getattr(assistant.generation_config, name) == value
    assert assisted.outputs == alone.outputs
    assert all(len(tokens) == 24 for tokens in assisted.outputs.values())


def test_best_ceiling_is_the_highest_among_the_pinned_pipelined_modes():
    from bench.common import ModeResult
    from bench.nodes_report import best_ceiling

    modes = {"b_sequential": ModeResult(ceiling_tok_s=20.0),  # not pipelined
             "c_pipelined_k2": ModeResult(ceiling_tok_s=12.7),
             "c_pipelined_k3": ModeResult(ceiling_tok_s=12.1),
             "c_pipelined_k4": ModeResult(),  # no verify timed
             "d_pipelined_adaptive": ModeResult(ceiling_tok_s=12.5),
             "g_whole_machine_pipelined_1t": ModeResult(ceiling_tok_s=13.1)}  # unpinned
    assert best_ceiling(modes) == ("c_pipelined_k2", 12.7)
    assert best_ceiling({"b_sequential": ModeResult(ceiling_tok_s=20.0)}) == (None, None)


def test_a_tandem_mode_counts_its_requests_re_syncs_and_rounds_without_the_draft():
    from types import SimpleNamespace

    from bench.common import TandemTally
    from tandem.v1 import tandem_pb2

    replies = iter([(0, 0), (2, 1), (1, 0)])

    class Client:
        def generate(self, **params):
            misses, undrafted = next(replies)
            stats = tandem_pb2.SpeculationStats(rounds=4, accepted_tokens=5, rejected_rounds=2, mean_k=2.0,
                                                cache_misses=misses, undrafted_rounds=undrafted)
            return SimpleNamespace(token_ids=[1] * 9, stats=stats, acceptance_rate=0.7)

    tally = TandemTally()
    for name in ("p1", "p2", "p3"):
        tally.time(Client(), name, [1, 2], 9)
    result = tally.result()
    assert (result.cache_misses, result.undrafted_rounds, result.prompts, result.tokens) == (3, 1, 3, 27)


def test_theory_tokens_per_round_averages_tau_over_the_block_lengths():
    from bench.common import theory_tokens_per_round
    from orchestrator.policy import expected_tokens_per_round as tau

    assert theory_tokens_per_round(0.8, [0, 0, 0, 10]) == pytest.approx(tau(0.8, 3))
    # Half the rounds at k = 2, half at k = 3: the mean of τ, not τ at k = round(2.5) = 2.
    assert theory_tokens_per_round(0.8, [0, 0, 5, 5]) == pytest.approx((tau(0.8, 2) + tau(0.8, 3)) / 2)
    assert theory_tokens_per_round(0.8, [4]) == 1.0  # rounds on the target alone commit one token
    assert theory_tokens_per_round(0.8, []) == 0.0


def test_the_grpc_floor_probe_times_round_trips_beyond_the_echo_sides_work(tmp_path):
    """bench.grpc_floor: a bare grpc.aio round trip between two pinned processes,
    the echo side's memory touch sent back and subtracted; the caller's cores
    are given back."""
    import json
    import os

    from bench import grpc_floor

    before = os.sched_getaffinity(0)
    cores = sorted(before)
    out = tmp_path / "floor.json"
    assert grpc_floor.main(["--messages", "30", "--touch-mb", "0,16", "--cores", f"{cores[0]},{cores[-1]}",
                            "--out", str(out)]) == 0
    assert os.sched_getaffinity(0) == before
    rows = json.loads(out.read_text())["results"]
    assert [r["touch_mb"] for r in rows] == [0, 16]
    for r in rows:
        assert r["round_trips"] == 30
        assert 0 < r["p10_ms"] <= r["p50_ms"] <= r["p90_ms"]
    # the echo side's touch: none without memory to stream, timed and sent back with it
    assert rows[0]["touch_ms_p50"] == 0 < rows[1]["touch_ms_p50"]


def test_the_grpc_floor_probe_refuses_cores_it_may_not_use():
    from bench import grpc_floor

    with pytest.raises(SystemExit):
        grpc_floor.main(["--cores", "0,4096"])


def test_the_step_probe_times_each_draft_path_and_the_target(tiny_models, tmp_path):
    """bench.step_probe on the CPU: the draft's step through Hugging Face's
    forward and the lean one (no CUDA graph off a GPU), each path's greedy
    tokens against Hugging Face's (float32: the same), and the target's forwards."""
    import json

    from bench import step_probe

    out = tmp_path / "steps.json"
    assert step_probe.main(["--target", tiny_models["target"], "--draft", tiny_models["other"], "--dtype", "float32",
                            "--steps", "6", "--reps", "3", "--warmups", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["draft_step"]) == {"hf", "lean"}
    assert result["draft_step"]["lean"]["same_tokens_as_hf"] == 6
    assert result["draft_step"]["lean"]["max_abs_logit_diff_vs_hf"] < 1e-3
    assert set(result["target_forward"]) == {"1", "4"}
    assert all(entry["median_ms"] > 0 and entry["n"] == 3 for entry in result["target_forward"].values())
    assert result["draft_step_over_verify"]["hf"] > 0


def test_the_verify_probe_times_each_path_and_leaves_no_thread(tiny_models, tmp_path):
    """bench.verify_probe on the CPU: every path timed the asked number of
    calls, a profile of the verifier's calls, and its worker threads gone after."""
    import json
    import threading

    from bench import verify_probe

    before = set(threading.enumerate())  # earlier tests' threads may end meanwhile: only new ones count
    out = tmp_path / "verify.json"
    assert verify_probe.main(["--target", tiny_models["target"], "--dtype", "float32", "--reps", "3", "--warmups", "1",
                              "--idle-ms", "1", "--profile", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["paths"]) == {"bare", "verifier", "verifier_thread", "verifier_spin", "verifier_after_idle", "tree"}
    assert all(entry["n"] == 3 and entry["median_ms"] > 0 for entry in result["paths"].values())
    assert result["alternatives"] == 3 and result["profile"]["top_by_host_time"]
    assert set(threading.enumerate()) - before == set()


def test_the_verify_probes_polling_worker_takes_no_cpu_between_its_own_calls():
    """bench.verify_probe's polling worker polls from arm() to the end of its
    call and blocks otherwise, so the other paths' calls do not share their
    core with it: this process takes CPU time while it is armed (each poll a
    time.sleep(0), about a quarter of a core on Linux, where that sleeps for
    the timer slack) and next to none while it waits unarmed after a call."""
    import time

    from bench.verify_probe import Spinner

    def cpu_over(seconds: float) -> float:
        start = time.process_time()
        time.sleep(seconds)
        return time.process_time() - start

    spinner = Spinner()
    try:
        assert spinner.run(lambda x: x + 1, 1) == 2
        idle = cpu_over(0.3)
        spinner.arm()
        polling = cpu_over(0.3)
        assert spinner.run(lambda: "done") == "done"
        after = cpu_over(0.3)
    finally:
        spinner.stop()
    assert polling > 0.02, f"armed, the worker should poll: {polling:.4f} s of CPU in 0.3 s"
    assert idle < 0.01 and after < 0.01, f"unarmed, the worker should block: {idle:.4f} / {after:.4f} s of CPU"


def test_a_random_pair_member_has_the_architecture_and_tokenizer_it_copies(tiny_models, tmp_path):
    from transformers import AutoConfig

    from bench.random_pair import build

    out = build(Path(tiny_models["other"]), tmp_path / "random", seed=1, dtype="float32")
    like, built = AutoConfig.from_pretrained(tiny_models["other"]), AutoConfig.from_pretrained(out)
    assert (built.model_type, built.hidden_size, built.num_hidden_layers) == \
        (like.model_type, like.hidden_size, like.num_hidden_layers)
    assert (out / "model.safetensors").is_file()


def test_the_i4w_probe_times_every_layer_of_the_drafts_shape(tiny_models, tmp_path):
    """bench.i4w_probe: one pass a repeat over all of the draft's linear layers
    (7 a decoder layer) and its head, for each row count, with the sum's rate
    beside them; the caller's cores and threads are given back."""
    import json
    import os

    import torch
    from transformers import AutoConfig

    from bench import i4w_probe
    from tandem import i4w

    if i4w.unavailable() is not None:
        pytest.skip(f"i4w kernel: {i4w.unavailable()}")
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    out = tmp_path / "probe.json"
    assert i4w_probe.main(["--draft", tiny_models["other"], "--head", "64", "--rows", "1,2", "--repeats", "2",
                           "--out", str(out)]) == 0
    assert os.sched_getaffinity(0) == before and torch.get_num_threads() == threads
    result = json.loads(out.read_text())
    config = AutoConfig.from_pretrained(tiny_models["other"])
    assert result["layers"] == 7 * config.num_hidden_layers + 1
    hidden, inter = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * (hidden // config.num_attention_heads)
    kv = config.num_key_value_heads * (hidden // config.num_attention_heads)
    weights = config.num_hidden_layers * (2 * q * hidden + 2 * kv * hidden + 3 * inter * hidden) + 64 * hidden
    assert result["weight_bytes"] == weights * 5 // 8  # 4-bit codes, and an fp16 scale and low value per 32
    assert set(result["rows"]) == {"1", "2"}
    assert all(r["best_ms"] > 0 and r["best_ms"] <= r["median_ms"] for r in result["rows"].values())
    assert result["torch_sum"]["best_gb_s"] > 0


def test_the_i4w_probe_refuses_bad_rows_and_cores(tiny_models):
    from bench import i4w_probe
    from tandem import i4w

    if i4w.unavailable() is not None:
        pytest.skip(f"i4w kernel: {i4w.unavailable()}")
    with pytest.raises(SystemExit):
        i4w_probe.main(["--draft", tiny_models["other"], "--rows", "0"])
    assert i4w_probe.main(["--draft", tiny_models["other"], "--core", "4096"]) == 2
