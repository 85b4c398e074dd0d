"""make bench-nodes end to end on tiny models: every mode runs, through real
service processes, and every mode's greedy tokens equal the target alone's."""
import json


def run_bench(main, char_models, out, *flags) -> dict:
    """A benchmark's main() on the tiny pair (draft unquantized), and the JSON it wrote to `out`."""
    code = main(["--target", char_models["target"], "--draft", char_models["draft"], "--draft-args", "", *flags,
                 "--out", str(out)])
    assert code == 0
    return json.loads(out.read_text())


def test_bench_nodes_runs_every_mode_and_each_equals_the_target_alone(char_models, tmp_path, monkeypatch):
    import bench.hf_baselines
    from bench.nodes import main

    runs = []  # (assisted?, max_new_tokens) of every HF generate the benchmark makes
    real_run = bench.hf_baselines._hf_run

    def recorded_run(model, ids, max_new_tokens, assistant=None):
        runs.append((assistant is not None, max_new_tokens))
        return real_run(model, ids, max_new_tokens, assistant)

    monkeypatch.setattr(bench.hf_baselines, "_hf_run", recorded_run)

    out = tmp_path / "nodes.json"
    result = run_bench(main, char_models, out, "--prompts", "code-1,prose-1", "--new-tokens", "12", "--fixed-ks", "2",
                       "--whole-configs", "sequential:1,pipelined:1", "--dtype", "float32")
    assert result["draft_backend"] == "model/batch=8/lean"  # the draft service's own label, unquantized, batching (auto)
    modes = result["modes"]
    assert {"a_target_one_core", "b_sequential", "c_pipelined_k2", "d_pipelined_adaptive", "e_target_both_cores",
            "f_hf_assisted_both_cores", "g_whole_machine_sequential_1t", "g_whole_machine_pipelined_1t"} <= set(modes)
    assert list(modes)[0] == "a_target_one_core"  # the table's order: (a) first, Tandem's own kernels leading
    # Beside the other configurations' (a), Tandem's own is timed again, as they were.
    assert ("a_target_one_core_own_first" in modes) == (len(result["baselines"]) > 1)
    for name, mode in modes.items():
        passes = 2 if name.startswith("f_") else 1  # (f) runs beside each of the two (g) configurations
        assert mode["prompts"] == 2 and mode["tokens"] == 24 * passes, name
        assert mode["identical"] == 2, name  # greedy, float32: every mode's tokens are the target alone's
        if name[0] in "bcdg":  # Tandem's modes: no re-sync, no round without the draft
            assert mode["cache_misses"] == mode["undrafted_rounds"] == 0, name
        assert mode["tok_s"] > 0, name
    for key in ("speedup_pipelined_vs_target_one_node", "speedup_pipelined_vs_sequential",
                "speedup_whole_machine_vs_hf_assisted"):
        assert result[key] > 0, key
    assert modes["d_pipelined_adaptive"]["tried_per_position"], "the adaptive mode's per-position counts"
    # --pipeline auto: its requests carry no pipeline field, and the pinned
    # orchestrator picks; (d) pre-drafted on every prompt, (b) on none.
    assert "d_pipeline_auto" in modes and 0 <= modes["d_pipeline_auto"]["pipelined_prompts"] <= 2
    assert modes["d_pipelined_adaptive"]["pipelined_prompts"] == 2 and modes["b_sequential"]["pipelined_prompts"] == 0
    assert result["speedup_pipeline_auto_vs_sequential"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
    # (f) is HF assisted: its 2 prompts, timed beside each of the 2 (g) configurations, ran with the draft
    assert runs.count((True, 12)) == 4


def test_own_baseline_only_times_the_target_alone_in_tandems_kernels_only(char_models, tmp_path):
    """--own-baseline-only (A/B runs of Tandem's settings) skips the target
    alone in every other configuration, and the JSON says which it timed."""
    from bench.nodes import main

    out = tmp_path / "nodes.json"
    result = run_bench(main, char_models, out, "--prompts", "code-1", "--new-tokens", "8", "--fixed-ks", "2",
                       "--skip", "e,f,g", "--own-baseline-only")
    assert len(result["baselines"]) == 1
    assert [name for name in result["modes"] if name.startswith("a_")] == ["a_target_one_core"]
    assert {"b_sequential", "c_pipelined_k2", "d_pipelined_adaptive"} <= set(result["modes"])


def test_the_overlap_probe_runs_each_setting_and_auto_follows_the_placement(char_models, tmp_path):
    """bench.overlap_probe: one unpinned deployment per --prefill-overlap
    setting, real service processes at two torch threads each; the server says
    which it chose, and auto overlaps only where 4 threads fit this machine's CPUs."""
    import os

    from bench.overlap_probe import main

    out = tmp_path / "overlap.json"
    assert main(["--target", char_models["target"], "--draft", char_models["draft"], "--draft-args", "",
                 "--dtype", "float32", "--settings", "on,off,auto", "--config", "sequential:2",
                 "--prompts", "code-1,prose-1", "--new-tokens", "6", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [run["setting"] for run in runs] == ["on", "off", "auto"]
    assert [run["overlapped"] for run in runs] == [True, False, 2 + 2 <= len(os.sched_getaffinity(0))]
    for run in runs:
        assert run["tok_s"] > 0 and set(run["first_token_ms"]) == {"code-1", "prose-1"}
        assert all(ms > 0 for ms in run["first_token_ms"].values())


def test_ab_runs_both_sides_in_both_start_orders_and_a_setting_that_keeps_outputs_keeps_them(char_models, tmp_path):
    """bench.ab: two deployments up at once, each prompt on both, in two halves
    (A started first, then B); the relay changes where a draft starts, never
    a token (float32, greedy)."""
    from bench.ab import main

    out = tmp_path / "ab.json"
    result = run_bench(main, char_models, out, "--b-orchestrator-args", "--relay on", "--prompts", "code-1,prose-1",
                       "--new-tokens", "10", "--modes", "b,d")
    assert result["sides"]["b"]["orchestrator_args"] == "--relay on"
    assert [half["started_first"] for half in result["halves"]] == ["a", "b"]
    for half in result["halves"]:
        for which in "ab":
            modes = half["modes"][which]
            assert set(modes) == {"b_sequential", "d_pipelined_adaptive"}
            for name, mode in modes.items():
                assert mode["prompts"] == 2 and mode["tokens"] == 20 and mode["tok_s"] > 0, (which, name)
        assert half["modes"]["b"]["b_sequential"]["relayed_draft_rate"] > 0  # B relayed, A did not
        assert half["modes"]["a"]["b_sequential"]["relayed_draft_rate"] == 0
    assert result["same_tokens"] == {"b_sequential": 4, "d_pipelined_adaptive": 4}
    for mode, (first, second) in result["b_over_a_tok_s_per_half"].items():
        assert abs(result["b_over_a_tok_s"][mode] - (first * second) ** 0.5) < 1e-9
        assert abs(result["second_over_first_tok_s"][mode] - (first / second) ** 0.5) < 1e-9
