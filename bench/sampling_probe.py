"""What sampling costs a round beside greedy decoding: one deployment of the
pair, the same prompts decoded greedy and sampled (temperature, a seed per
request), alternating, side by side in one run; before it, the target alone
(Hugging Face's generate on the kernels the target service would use, one
pass over the prompts), greedy and sampled alike, for Tandem's speedup in each.

Under sampling every drafted token's draft distribution goes from the draft
to the orchestrator and on to the target (DESIGN §4), which checks it and
keeps it for the residual draw at a rejection. This probe shows what that
adds to each round: the overhead per round (a round's time beyond the
services' compute, and the part of it in their handlers), and the bytes of
distributions forwarded per round (SpeculationStats.draft_distribution_bytes).

    python -m bench.sampling_probe                     # the default pair, 4 prompts x 64 tokens, 2 reps
    python -m bench.sampling_probe --temperature 1.0 --top-p 0.9
    python -m bench.sampling_probe --no-target-alone   # Tandem only

Writes bench/results/sampling_probe.json."""
from __future__ import annotations

import argparse
import gc
import logging
import statistics
import time
from pathlib import Path

from bench.common import (PROMPTS, RESULTS, cut, machine, pair_deployment, pair_flags, pair_record, parse_args,
                          request_flags, write)
from bench.hf_baselines import load_hf, resolve_dtype
from tandem.client import TandemClient

log = logging.getLogger("bench.sampling_probe")
MODES = ("greedy", "sampled")


def _one(client: TandemClient, prompt: str, new_tokens: int, params: dict) -> dict:
    result = client.generate(prompt, max_tokens=new_tokens, ignore_eos=True, **params)
    stats = result.stats
    return {"tokens": len(result.token_ids), "total_s": stats.total_ms / 1e3, "rounds": stats.rounds,
            "accepted": stats.accepted_tokens, "rejected_rounds": stats.rejected_rounds,
            "overhead_ms_p50": stats.overhead_ms_p50, "in_services_ms_p50": stats.overhead_in_services_ms_p50,
            "verify_ms_p50": stats.verify_ms_p50, "draft_step_ms_p50": stats.draft_step_ms_p50,
            "distribution_bytes": stats.draft_distribution_bytes, "predraft_hits": stats.predraft_hits,
            "predraft_attempts": stats.predraft_attempts, "mean_k": stats.mean_k, "ids": list(result.token_ids)}


def target_alone(target: str, dtype: str, prompts: dict[str, str], new_tokens: int, sampling: dict,
                 threads: int) -> dict:
    """Tokens/s of the target alone, greedy and sampled, one pass over the
    prompts each (after an untimed warm-up), every request to new_tokens, on
    `threads` torch threads. The process's thread count and random state are
    as they were after, so that a caller (a test) is left as it was."""
    import torch

    from tandem.default_models import resolve_model

    path = resolve_model(target)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng(devices=[]):
            return _time_target_alone(path, dtype, prompts, new_tokens, sampling)
    finally:
        torch.set_num_threads(before)


def _time_target_alone(path: str, dtype: str, prompts: dict[str, str], new_tokens: int, sampling: dict) -> dict:
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = load_hf(path, resolve_dtype(dtype))
    ids = {name: tokenizer(prompt, return_tensors="pt").input_ids for name, prompt in prompts.items()}
    modes = {"greedy": dict(do_sample=False),
             "sampled": dict(do_sample=True, temperature=sampling["temperature"], top_p=sampling["top_p"],
                             top_k=sampling["top_k"])}

    def generate(x, count: int, params: dict) -> int:
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=count, min_new_tokens=count,
                                 pad_token_id=tokenizer.eos_token_id, **params)
        return out.shape[1] - x.shape[1]

    result = {}
    for mode, params in modes.items():
        generate(next(iter(ids.values())), 8, params)  # warm-up
        torch.manual_seed(0)
        tokens, seconds = 0, 0.0
        for name, x in ids.items():
            start = time.perf_counter()
            tokens += generate(x, new_tokens, params)
            seconds += time.perf_counter() - start
        result[mode] = {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds}
        log.info("target alone, %s: %.2f tok/s", mode, tokens / seconds)
    return result


def run(address: str, prompts: dict[str, str], new_tokens: int, reps: int, sampling: dict) -> dict:
    def params(mode: str, seed: int) -> dict:  # a sampled request's seed; greedy needs none
        return dict(sampling, seed=seed) if mode == "sampled" else {"temperature": 0.0}

    runs = {mode: [] for mode in MODES}
    with TandemClient(address, timeout_s=600) as client:
        for mode in MODES:  # warm-up: the first sampled call builds what sampling needs
            _one(client, next(iter(prompts.values())), 8, params(mode, seed=1))
        for rep in range(reps):
            for index, (name, prompt) in enumerate(prompts.items()):
                for mode in (MODES if (rep + index) % 2 == 0 else MODES[::-1]):  # alternate who goes first
                    row = _one(client, prompt, new_tokens, params(mode, seed=1000 * rep + index))
                    runs[mode].append(dict(row, prompt=name, rep=rep))
                    log.info("%s %s rep %d: %.2f tok/s, overhead p50 %.2f ms (in the services %.2f), %d rounds, "
                             "%d distribution bytes", name, mode, rep, row["tokens"] / row["total_s"],
                             row["overhead_ms_p50"], row["in_services_ms_p50"], row["rounds"],
                             row["distribution_bytes"])
    summary = {}
    for mode, rows in runs.items():
        rounds = sum(r["rounds"] for r in rows)
        accepted = sum(r["accepted"] for r in rows)
        summary[mode] = {
            "tok_s": sum(r["tokens"] for r in rows) / sum(r["total_s"] for r in rows),
            "overhead_ms_p50": statistics.median(r["overhead_ms_p50"] for r in rows),
            "in_services_ms_p50": statistics.median(r["in_services_ms_p50"] for r in rows),
            "verify_ms_p50": statistics.median(r["verify_ms_p50"] for r in rows),
            "draft_step_ms_p50": statistics.median(r["draft_step_ms_p50"] for r in rows),
            "acceptance_rate": accepted / max(1, accepted + sum(r["rejected_rounds"] for r in rows)),
            "tokens_per_round": sum(r["tokens"] for r in rows) / max(1, rounds),
            "distribution_bytes_per_round": sum(r["distribution_bytes"] for r in rows) / max(1, rounds),
            "predraft_hit_rate": sum(r["predraft_hits"] for r in rows) / max(1, sum(r["predraft_attempts"] for r in rows)),
            "mean_k": sum(r["mean_k"] * r["rounds"] for r in rows) / max(1, rounds),
            "requests": len(rows),
        }
    return {"modes": summary,
            "runs": {m: [{k: v for k, v in r.items() if k != "ids"} for r in rows] for m, rows in runs.items()},
            "sampled_minus_greedy_overhead_ms_p50": summary["sampled"]["overhead_ms_p50"]
            - summary["greedy"]["overhead_ms_p50"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sampling_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    pair_flags(parser)
    request_flags(parser, reps=2)
    parser.add_argument("--temperature", type=float, default=0.8, help="sampled mode's temperature (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sampled mode's top_p (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=0, help="sampled mode's top_k, 0 = off (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per service, and the target alone's (default: %(default)s)")
    parser.add_argument("--no-target-alone", dest="target_alone", action="store_false",
                        help="skip the target alone (Tandem's modes only)")
    parser.add_argument("--out", type=Path, default=RESULTS / "sampling_probe.json", help="JSON output path")
    args = parse_args(parser, argv)
    if args.temperature <= 0:
        parser.error("--temperature must be above 0: the sampled mode samples")
    prompts = {name: PROMPTS[name] for name in args.prompts.split(",")}
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    alone = (target_alone(args.target, args.dtype, prompts, args.new_tokens, sampling, args.threads)
             if args.target_alone else None)
    gc.collect()  # the target alone's model, before the services load theirs
    with pair_deployment(args, ["--prefix-cache", "0"]) as deployment:  # each request prefills its prompt
        result = run(deployment.address, prompts, args.new_tokens, args.reps, sampling)
    if alone is not None:
        result["target_alone"] = alone
        result["speedup_vs_target_alone"] = {mode: result["modes"][mode]["tok_s"] / alone[mode]["tok_s"]
                                             for mode in MODES}
    result.update(**pair_record(args), new_tokens=args.new_tokens, sampling=sampling, machine=machine())
    write(args.out, result)
    print(f"{'mode':<8} {'tok/s':>7} {'overhead ms p50':>16} {'in services':>12} {'bytes/round':>12} {'alpha':>6} "
          f"{'mean k':>7} {'pre-draft hits':>15}")
    for mode, row in result["modes"].items():
        print(f"{mode:<8} {row['tok_s']:7.2f} {row['overhead_ms_p50']:16.2f} {row['in_services_ms_p50']:12.2f} "
              f"{row['distribution_bytes_per_round']:12.0f} {row['acceptance_rate']:6.3f} {row['mean_k']:7.2f} "
              f"{row['predraft_hit_rate']:15.3f}")
    if alone is not None:
        print("over the target alone (cut): " + ", ".join(
            f"{mode} {cut(result['speedup_vs_target_alone'][mode]):.2f}x ({alone[mode]['tok_s']:.2f} tok/s alone)"
            for mode in MODES))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
