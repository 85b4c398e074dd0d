"""What make bench-nodes reports from its modes' results: the table and the
readings under it, the JSON payload with the issue's ratios, and the PNG."""
from __future__ import annotations

from pathlib import Path

from bench.common import ModeResult, cut, machine, table


def best_ceiling(modes: dict[str, ModeResult]) -> tuple[str, float] | tuple[None, None]:
    """The pinned pipelined mode, (c) at each k or (d), with the highest ceiling
    (tokens per round over its median verify time), and that ceiling in tok/s.
    Every round costs at least its verify, so a pipelined run at these k, or
    at any mix of them, passes it only by as much as its verifies run faster
    than these medians, even with drafting fully hidden and no overhead."""
    ceilings = {name: r.ceiling_tok_s for name, r in modes.items()
                if name.startswith(("c_pipelined", "d_pipelined")) and r.ceiling_tok_s}
    if not ceilings:
        return None, None
    name = max(ceilings, key=ceilings.get)
    return name, ceilings[name]


def report(modes: dict[str, ModeResult], args, configs: list[tuple[str, str]], prompts: list[str], gpu: bool,
           hf_assisted: dict) -> dict:
    """Prints the table of `modes` (in table order, "identical" counted by the caller) and
    what it shows about the goals; returns the JSON payload. `configs`: the
    target alone's configurations (dtype, linear), Tandem's own first."""
    from tandem.cpu_kernels import config_label

    def tok_s(name):
        """A mode's tokens/s; for a baseline, the best over its configurations."""
        rates = [r.tok_s for n, r in modes.items() if n == name or n.startswith(name + "_")]
        return max(rates) if rates else None

    def ratio(a, b):
        return tok_s(a) / tok_s(b) if tok_s(a) and tok_s(b) else None

    adaptive = modes["d_pipelined_adaptive"]
    sequential = modes["b_sequential"]
    baseline = max((r for n, r in modes.items() if n.startswith("a_target_one_core")), key=lambda r: r.tok_s)
    print("\n" + table(list(modes.items()), baseline))
    print("identical: prompts equal to the target alone in", args.dtype, "(mode a_target_one_core)")
    print("verify, step: the services' median compute per verify and per draft step, ms; ceil: tokens/round "
          "over the verify time, the tok/s if drafting and overhead cost nothing; ovh ms: the orchestrator's "
          "overhead per round on the critical path; hand: its Redis commit and stream write per round, which "
          "overlap the next round's calls")
    ms_per_token = 1e3 / baseline.tok_s
    if sequential.verify_ms_p50:
        print(f"a verify of {sequential.mean_k:.0f}+1 tokens (b) costs {sequential.verify_ms_p50 / ms_per_token:.2f} "
              f"one-token decodes of the fastest target alone ({ms_per_token:.0f} ms); the pipelined ceiling (d) is "
              f"{cut((adaptive.ceiling_tok_s or 0) / baseline.tok_s):.2f}x the target alone on one node")
    if adaptive.overhead_ms_predrafted_p50 is not None and adaptive.overhead_ms_drafted_after_p50 is not None:
        print(f"(d)'s overhead p50 {adaptive.overhead_ms_per_round_p50:.2f} ms: {adaptive.overhead_ms_predrafted_p50:.2f} ms "
              f"over rounds whose next block was pre-drafted (one model call on the critical path), "
              f"{adaptive.overhead_ms_drafted_after_p50:.2f} ms over those drafted after the verify (two)")
    if sequential.alternative_hit_rate or adaptive.alternative_hit_rate:
        print(f"alternatives (--tree-width) taken in {sequential.alternative_hit_rate or 0:.0%} of (b)'s rounds and "
              f"{adaptive.alternative_hit_rate or 0:.0%} of (d)'s, each one token more: tokens/round (b) "
              f"{sequential.tokens_per_round:.2f}, (d) {adaptive.tokens_per_round:.2f} (the table's tok/rnd counts the "
              f"block's tokens alone, as τ does)")
    if adaptive.relayed_draft_rate:
        print(f"(d): the target's relay began {adaptive.relayed_draft_rate:.0%} of the blocks drafted after a verify")
    for label, r in (("(b)", sequential), ("(d)", adaptive)):
        if r.overhead_in_services_ms_p50 is not None and r.overhead_ms_per_round_p50 is not None:
            print(f"{label}'s overhead p50 {r.overhead_ms_per_round_p50:.2f} ms: {r.overhead_in_services_ms_p50:.2f} ms p50 "
                  f"in the services' handlers beyond their compute, the rest gRPC both ways and the orchestrator")
    troubled = [f"{name} ({r.cache_misses} re-syncs, {r.undrafted_rounds} rounds without the draft)"
                for name, r in modes.items() if r.cache_misses or r.undrafted_rounds]
    if troubled:
        print("lost time beyond the table's: " + "; ".join(troubled))
    first, own = modes.get("a_target_one_core_own_first"), modes.get("a_target_one_core")
    if first is not None and first.tok_s and own is not None and own.tok_s:
        print(f"Tandem's own target alone ran {first.tok_s:.2f} tok/s right after the other configurations' (a) and "
              f"{own.tok_s:.2f} between the Tandem modes ({own.tok_s / first.tok_s - 1:+.1%}: the machine's drift "
              f"between the two phases, which the other configurations' (a) share with the first)")
    auto = modes.get("d_pipeline_auto")
    if auto is not None and auto.tok_s and sequential.tok_s and adaptive.tok_s:
        print(f"--pipeline auto pre-drafted in {auto.pipelined_prompts} of its {auto.prompts} prompts and ran "
              f"{cut(auto.tok_s / sequential.tok_s):.2f}x (b) and {cut(auto.tok_s / adaptive.tok_s):.2f}x (d)")
    best_name, best_tok_s = best_ceiling(modes)
    if best_tok_s and sequential.tok_s:
        print(f"the highest pipelined ceiling, {best_name}'s {best_tok_s:.2f} tok/s, is "
              f"{cut(best_tok_s / sequential.tok_s):.2f}x Tandem sequential (b) and "
              f"{cut(best_tok_s / baseline.tok_s):.2f}x the target alone on one node")
    payload = {
        "modes": {name: {k: v for k, v in vars(r).items() if k != "outputs"} for name, r in modes.items()},
        "speedup_pipelined_vs_target_one_node": ratio("d_pipelined_adaptive", "a_target_one_core"),
        "speedup_pipelined_vs_sequential": ratio("d_pipelined_adaptive", "b_sequential"),
        "speedup_whole_machine_vs_hf_assisted": ratio("d_pipelined_adaptive" if gpu else "g_whole_machine",
                                                      "f_hf_assisted_both_cores"),
        "speedup_pipeline_auto_vs_sequential": ratio("d_pipeline_auto", "b_sequential"),
        "speedup_pipeline_auto_vs_pipelined": ratio("d_pipeline_auto", "d_pipelined_adaptive"),
        "acceptance_rate": adaptive.acceptance_rate,
        "tokens_per_round": adaptive.tokens_per_round,
        "theory_tokens_per_round": adaptive.theory_tokens_per_round,
        "sequential_tokens_per_round": sequential.tokens_per_round,
        "sequential_block_tokens_per_round": sequential.block_tokens_per_round,
        "alternative_hit_rate": adaptive.alternative_hit_rate,
        "sequential_alternative_hit_rate": sequential.alternative_hit_rate,
        "sequential_theory_tokens_per_round": sequential.theory_tokens_per_round,
        "predraft_hit_rate": adaptive.predraft_hit_rate,
        "overhead_ms_per_round_p50": adaptive.overhead_ms_per_round_p50,
        "overhead_ms_per_round_p50_predrafted": adaptive.overhead_ms_predrafted_p50,
        "overhead_ms_per_round_p50_drafted_after": adaptive.overhead_ms_drafted_after_p50,
        "overhead_in_services_ms_p50": adaptive.overhead_in_services_ms_p50,
        "handover_ms_per_round_p50": adaptive.handover_ms_per_round_p50,
        "relayed_draft_rate": adaptive.relayed_draft_rate,
        "target_alone_ms_per_token": ms_per_token,
        "sequential_verify_ms_p50": sequential.verify_ms_p50,
        "sequential_verify_in_target_tokens": sequential.verify_ms_p50 / ms_per_token if sequential.verify_ms_p50 else None,
        "pipelined_ceiling_tok_s": adaptive.ceiling_tok_s,
        "pipelined_ceiling_vs_target_one_node": adaptive.ceiling_tok_s / baseline.tok_s if adaptive.ceiling_tok_s else None,
        "pipelined_ceiling_best_mode": best_name,
        "pipelined_ceiling_best_tok_s": best_tok_s,
        "pipelined_ceiling_best_vs_sequential": best_tok_s / sequential.tok_s if best_tok_s else None,
        "pipelined_ceiling_best_vs_target_one_node": best_tok_s / baseline.tok_s if best_tok_s else None,
        "sequential_overhead_ms_per_round_p50": sequential.overhead_ms_per_round_p50,
        "sequential_overhead_in_services_ms_p50": sequential.overhead_in_services_ms_p50,
        "device": args.device,
        "dtype": args.dtype,
        "baselines": [config_label(*c) for c in configs],
        "draft_args": args.draft_args,
        "draft_backend": args.draft_backend,
        "target_args": args.target_args,
        "orchestrator_args": args.orchestrator_args,
        "hf_assisted": hf_assisted,
        "whole_machine": {"configs": [{"pipeline": p, "target_threads": t, "draft_threads": d}
                                      for p, t, d in args.whole_configs],
                          "fastest": max((n for n in modes if n.startswith("g_whole_machine")),
                                         key=lambda n: modes[n].tok_s, default=None)},
        "new_tokens": args.new_tokens,
        "prompts": prompts,
        "machine": machine(),
    }
    return payload


def plot(path: Path, modes: dict[str, ModeResult], per_position: list[int], tried: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = list(modes)
    left.barh(names, [modes[n].tok_s for n in names], color=["#888" if not n[0] in "bcdg" else "#2a7" for n in names])
    left.set_xlabel("tokens / s")
    left.set_title("Throughput per mode")
    left.invert_yaxis()
    rates = [a / t if t else 0 for a, t in zip(per_position, tried)]
    right.bar(range(1, len(rates) + 1), rates, color="#27a")
    right.set_xlabel("draft position")
    right.set_ylabel("P(accepted | reached)")
    right.set_ylim(0, 1)
    right.set_title("Acceptance per draft position (pipelined, adaptive k)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
