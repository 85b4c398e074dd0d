"""Time to first token of Tandem on the whole machine, unpinned (the way
`make bench-nodes` runs mode (g)), under each `--prefill-overlap` setting in
turn: one deployment per setting, warmed up on every prompt, then each
prompt once. Where the two services share the machine's CPUs with more torch
threads than CPUs, overlapping the two prefills slows both (tandem/placement.py).

    python -m bench.overlap_probe                          # on,off,auto; sequential, 2 threads each
    python -m bench.overlap_probe --settings on,off,on,off --config pipelined:1

Writes bench/results/overlap_probe.json: per run, tokens/s over the prompts
(first token included) and each prompt's time to first token, the
orchestrator's own (SpeculationStats.first_token_ms)."""
from __future__ import annotations

import argparse
import os
import sys
import types
from pathlib import Path

from bench.common import PROMPTS, RESULTS, TandemTally, machine, parse_args, prompt_ids, write
from bench.hf_baselines import resolve_dtype


def main(argv=None) -> int:
    from bench.nodes import deployment, whole_configs

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default="on,off,auto",
                        help="--prefill-overlap of each run, in order (default: %(default)s)")
    parser.add_argument("--config", type=whole_configs, default="sequential:2",
                        help="one MODE:THREADS or MODE:TARGET/DRAFT, as bench.nodes --whole-configs "
                             "(default: %(default)s)")
    parser.add_argument("--target", default="default-target", help="target model (default: %(default)s)")
    parser.add_argument("--draft", default="default-draft", help="draft model (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", help="as bench.nodes --dtype (default: %(default)s)")
    parser.add_argument("--draft-args", default="--quantize auto --vocab-subset 32768",
                        help="extra flags for the draft service (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per prompt (default: %(default)s)")
    parser.add_argument("--prompts", default=",".join(PROMPTS), help="comma-separated prompt names")
    parser.add_argument("--out", default=str(RESULTS / "overlap_probe.json"), help="JSON output path")
    args = parse_args(parser, argv)
    if len(args.config) != 1:
        parser.error("--config takes one configuration")
    whole = args.config[0]

    from transformers import AutoTokenizer

    from tandem.client import TandemClient
    from tandem.default_models import resolve_model

    prompts = prompt_ids(AutoTokenizer.from_pretrained(resolve_model(args.target)), args.prompts.split(","))
    cores = sorted(os.sched_getaffinity(0))
    runs = []
    for n, setting in enumerate(args.settings.split(",")):
        spec = types.SimpleNamespace(
            device="cpu", dtype=resolve_dtype(args.dtype), target=args.target, draft=args.draft, target_args="",
            draft_args=args.draft_args, threads_per_node=1, k_min=1, k_max=6,
            orchestrator_args=f"--prefill-overlap {setting}")
        print(f"run {n + 1}: --prefill-overlap {setting} …", flush=True)
        with deployment(spec, str(cores[0]), str(cores[-1]), pinned=False, whole=whole) as running:
            with TandemClient(running.address, timeout_s=3600) as client:
                chosen = client.server_info().prefill_overlap
                warm = TandemTally()
                for name, ids in prompts.items():
                    warm.time(client, name, ids, 16, pipeline=whole[0])
                tally = TandemTally()
                for name, ids in prompts.items():
                    tally.time(client, name, ids, args.new_tokens, pipeline=whole[0])
        result = tally.result()
        runs.append({"setting": setting, "overlapped": chosen, "tok_s": result.tok_s,
                     "first_token_ms": dict(zip(prompts, tally.first_tokens))})
        print(f"  overlapped: {chosen}; {result.tok_s:.2f} tok/s; time to first token (ms): "
              + ", ".join(f"{ms:.0f}" for ms in tally.first_tokens), flush=True)
    write(Path(args.out), {"machine": machine(), "config": args.config[0], "new_tokens": args.new_tokens,
                           "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
