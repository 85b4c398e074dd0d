"""First benchmark (make bench): the default pair, greedy, side by side in one run:
the target alone (HF generate), HF assisted generation in-process, and Tandem
through its three services. Writes bench/results/latest.json."""
from __future__ import annotations

import argparse
import gc
import logging
import sys
from pathlib import Path

import torch

from bench.common import PROMPTS, RESULTS, count_identical, machine, parse_args, prompt_ids, table, tandem_generate, write
from bench.hf_baselines import baselines, hf_assisted_config, hf_generate, load_hf, resolve_dtype


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", default="default-target", help="target model (default: %(default)s)")
    parser.add_argument("--draft", default="default-draft", help="draft model (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="dtype of Tandem's models, HF assisted and the identity reference; auto = what a service "
                             "picks (tandem.cpu_kernels.auto_dtype) (default: %(default)s)")
    parser.add_argument("--baselines", default="",
                        help="also time the target alone in these configurations, e.g. 'bfloat16,float32/native'; "
                             "tandem.cpu_kernels.baseline_configs' others (float32 on its fastest layers, "
                             "float32/native, bfloat16) are always timed; speedups are over the fastest")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per prompt (default: %(default)s)")
    parser.add_argument("--prompts", default=",".join(PROMPTS), help="comma-separated prompt names")
    parser.add_argument("--k", type=int, default=3, help="draft tokens per round, for HF assisted and Tandem")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per model process (default: %(default)s)")
    parser.add_argument("--cheap-draft-args", default="--quantize auto --vocab-subset 32768",
                        help="also run Tandem with these draft flags ('' to skip) (default: %(default)s)")
    parser.add_argument("--out", default=str(RESULTS / "latest.json"), help="JSON output path")
    args = parse_args(parser, argv)
    for noisy in ("httpx", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from transformers import AutoTokenizer

    from tandem.cpu_kernels import config_label
    from tandem.default_models import resolve_model
    from tandem.launch import Deployment, Service
    from tandem.redis_local import ensure_redis

    target_path, draft_path = resolve_model(args.target), resolve_model(args.draft)
    prompts = prompt_ids(AutoTokenizer.from_pretrained(target_path), args.prompts.split(","))
    torch.set_num_threads(args.threads)

    args.dtype = resolve_dtype(args.dtype)
    other_targets = {}
    for dtype, linear in baselines(args.dtype, args.baselines)[1:]:
        label = config_label(dtype, linear)
        print(f"(a') target alone, {label} …", flush=True)
        other = load_hf(target_path, dtype, linear)
        other_targets[label] = hf_generate(other, prompts, args.new_tokens)
        del other
        gc.collect()
    target = load_hf(target_path, args.dtype)
    print(f"(a) target alone, {args.dtype} …", flush=True)
    target_only = hf_generate(target, prompts, args.new_tokens)
    fastest = max([target_only, *other_targets.values()], key=lambda r: r.tok_s)
    print("(b) HF assisted generation …", flush=True)
    draft = load_hf(draft_path, args.dtype)
    hf_assisted = hf_generate(target, prompts, args.new_tokens, assistant=draft, k=args.k)
    del target, draft
    gc.collect()

    print("(c) Tandem, three processes …", flush=True)
    redis_url = ensure_redis()
    services = (Service("target", ["--model", args.target, "--dtype", args.dtype], threads=args.threads),
                Service("draft", ["--model", args.draft, "--dtype", args.dtype], threads=args.threads))
    # --prefix-cache 0: each request prefills its prompt, as the HF modes do.
    orchestrator = ["--redis-url", redis_url, "--pipeline", "off", "--adaptive-k", "off", "--k", str(args.k),
                    "--prefix-cache", "0"]
    with Deployment(*services, orchestrator) as deployment:
        tandem_generate(deployment.address, prompts, 16)  # warm-up, as the HF modes get
        tandem = tandem_generate(deployment.address, prompts, args.new_tokens)
    cheap = None
    if args.cheap_draft_args:
        print(f"(d) Tandem with a cheaper draft ({args.cheap_draft_args}) …", flush=True)
        services = (Service("target", ["--model", args.target, "--dtype", args.dtype], threads=args.threads),
                    Service("draft", ["--model", args.draft, "--dtype", args.dtype, *args.cheap_draft_args.split()],
                            threads=args.threads))
        with Deployment(*services, orchestrator) as deployment:
            tandem_generate(deployment.address, prompts, 16)
            cheap = tandem_generate(deployment.address, prompts, args.new_tokens)

    target_only.identical = target_only.prompts
    for result in (hf_assisted, tandem, cheap):
        if result is not None:
            result.identical = count_identical(result, target_only)
    for dtype, other in other_targets.items():
        other.identical = count_identical(other, target_only)
    rows = [*((f"target alone, {d}", r) for d, r in other_targets.items()),
            (f"target alone, {args.dtype} (reference)", target_only), (f"HF assisted (k={args.k})", hf_assisted),
            (f"Tandem sequential (k={args.k})", tandem)]
    if cheap is not None:
        rows.append(("Tandem, quantized + 32k-head draft", cheap))
    print("\n" + table(rows, fastest))
    print(f"vs base: over the fastest target alone; same: prompts equal to the target alone in {args.dtype}")
    write(Path(args.out), {
        "target_only_tok_s": fastest.tok_s,  # the fastest target alone over the configurations tried
        "target_only_tok_s_by_config": {args.dtype: target_only.tok_s, **{d: r.tok_s for d, r in other_targets.items()}},
        "hf_assisted_tok_s": hf_assisted.tok_s,
        "hf_assisted": hf_assisted_config(args.k),
        "tandem_tok_s": tandem.tok_s,
        "speedup_vs_target_only": tandem.tok_s / fastest.tok_s,
        "speedup_vs_hf_assisted": tandem.tok_s / hf_assisted.tok_s,
        "hf_assisted_vs_target_only": hf_assisted.tok_s / fastest.tok_s,
        "acceptance_rate": tandem.acceptance_rate,
        "tokens_per_round": tandem.tokens_per_round,
        "block_tokens_per_round": tandem.block_tokens_per_round,  # without alternatives' extra tokens, as τ counts
        "theory_tokens_per_round": tandem.theory_tokens_per_round,
        "alternative_hit_rate": tandem.alternative_hit_rate,
        "k": args.k,
        "dtype": args.dtype,
        "threads_per_model": args.threads,
        "new_tokens": args.new_tokens,
        "identical_to_target_only": f"{tandem.identical}/{tandem.prompts}",
        "hf_assisted_identical_to_target_only": f"{hf_assisted.identical}/{hf_assisted.prompts}",
        "overhead_ms_per_round_p50": tandem.overhead_ms_per_round_p50,
        "machine": machine(),
        "cheap_draft": None if cheap is None else {
            "draft_args": args.cheap_draft_args, "tok_s": cheap.tok_s, "acceptance_rate": cheap.acceptance_rate,
            "speedup_vs_target_only": cheap.tok_s / fastest.tok_s,
            "speedup_vs_hf_assisted": cheap.tok_s / hf_assisted.tok_s,
            "identical_to_target_only": f"{cheap.identical}/{cheap.prompts}",
        },
        "modes": {name: {k: v for k, v in vars(r).items() if k != "outputs"}
                  for name, r in (("target_only", target_only), *((f"target_only_{d.replace('/', '_')}", r) for d, r in other_targets.items()),
                                  ("hf_assisted", hf_assisted), ("tandem", tandem),
                                  ("tandem_cheap_draft", cheap)) if r is not None},
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
