"""Two Tandem settings side by side (an A/B that a drifting machine cannot bias).

An A/B of two `bench.nodes` runs, one after the other, compares two moments of
the machine as much as two settings: the 2-core VMs in bench/RESULTS.md drift by
10-40% over tens of minutes, and on a freshly started VM the target alone ran
1.80 tok/s in one run and 3.39 half an hour later, with no change between. Here both
deployments are up at once, each pinned as `make bench-nodes` pins its two
nodes (target on the first core, draft on the second, one torch thread each),
and every prompt runs through each mode on A and on B back to back, the order
alternating, so that drift falls on both alike. Only one deployment computes at
a time; the other's services sit idle. It needs the memory of two (about 10 GB
for the default pair).

Where a deployment sits in memory matters too: on an AMX VM the deployment
started second ran 3.5% and 9.9% faster than the first, whichever setting it had
(bench/RESULTS.md). So the run has two halves, A started first, then B
started first, and B over A is the geometric mean of the two halves' ratios,
which cancels that bias; the bias itself is reported (second_over_first).

    python -m bench.ab --b-orchestrator-args "--relay on"
    python -m bench.ab --a-target-args "--linear bf16w" --b-target-args "--linear packed" --modes d

Writes bench/results/ab.json: each half's modes on each side (bench.nodes'
fields), B over A per mode and per half, and how many prompts gave the same
tokens on both sides."""
from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path

from bench.common import PROMPTS, RESULTS, TandemTally, parse_args, prompt_ids, write
from bench.hf_baselines import resolve_dtype

log = logging.getLogger("bench.ab")

STARTS = (("a", "b"), ("b", "a"))  # the two halves' start orders
MODES = {"b": ("b_sequential", "(b) sequential"), "c": ("c_pipelined_k{k}", "(c) pipelined, k={k}"),
         "d": ("d_pipelined_adaptive", "(d) pipelined, adaptive k")}


def mode_params(letter: str, k: int) -> tuple[str, dict]:
    """A mode letter -> (its name in bench.nodes' JSON, the request's parameters)."""
    name = MODES[letter][0].format(k=k)
    if letter == "b":
        return name, dict(pipeline=False, num_draft_tokens=k)
    if letter == "c":
        return name, dict(pipeline=True, num_draft_tokens=k)
    return name, dict(pipeline=True)


def side(args, which: str) -> argparse.Namespace:
    """The flags of bench.nodes.deployment for side `which` ('a' or 'b')."""
    extra = lambda role: getattr(args, f"{which}_{role}_args")  # noqa: E731
    return argparse.Namespace(device="cpu", dtype=args.dtype, target=args.target, draft=args.draft,
                              target_args=extra("target"), draft_args=f"{args.draft_args} {extra('draft')}".strip(),
                              orchestrator_args=extra("orchestrator"), threads_per_node=1,
                              k_min=args.k_min, k_max=args.k_max)


def _fields(result) -> dict:
    """A ModeResult as JSON fields, less its token lists."""
    return {key: value for key, value in asdict(result).items() if key != "outputs"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="default-target", help="target model (default: %(default)s)")
    parser.add_argument("--draft", default="default-draft", help="draft model (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="dtype of both sides' models (default: %(default)s)")
    parser.add_argument("--draft-args", default="--quantize auto --vocab-subset 32768",
                        help="draft service flags both sides share (default: %(default)s)")
    for which in "ab":
        for role in ("target", "draft", "orchestrator"):
            parser.add_argument(f"--{which}-{role}-args", default="",
                                help=f"extra flags for side {which.upper()}'s {role}" +
                                     (" (after --draft-args)" if role == "draft" else ""))
    parser.add_argument("--modes", default="b,d", help="mode letters of bench.nodes: b, c (k = --k), d "
                                                      "(default: %(default)s)")
    parser.add_argument("--k", type=int, default=3, help="k of (b) and (c) (default: %(default)s)")
    parser.add_argument("--k-min", type=int, default=1, help="adaptive k lower bound (default: %(default)s)")
    parser.add_argument("--k-max", type=int, default=6, help="adaptive k upper bound (default: %(default)s)")
    parser.add_argument("--prompts", default=",".join(PROMPTS), help="comma-separated prompt names")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per prompt (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="passes over the prompts in each half (default: %(default)s)")
    parser.add_argument("--out", default=str(RESULTS / "ab.json"), help="JSON output path")
    args = parse_args(parser, argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    letters = list(dict.fromkeys(m for m in args.modes.split(",") if m))
    if not letters or set(letters) - set(MODES) or args.rounds < 1 or args.new_tokens < 1 or args.k < 1:
        parser.error("--modes takes letters among b, c, d; --rounds, --new-tokens and --k must be >= 1")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("bench.ab pins each side's two services to two cores: this machine has one", file=sys.stderr)
        return 2
    args.dtype = resolve_dtype(args.dtype, "cpu")

    from transformers import AutoTokenizer

    from bench.nodes import deployment
    from tandem.client import TandemClient
    from tandem.default_models import resolve_model

    prompts = prompt_ids(AutoTokenizer.from_pretrained(resolve_model(args.target)), args.prompts.split(","))
    modes = [mode_params(letter, args.k) for letter in letters]
    # Each half starts both deployments, in its order, and runs every pass;
    # halves[h][which][mode] is a tally.
    halves = [{which: {name: TandemTally() for name, _ in modes} for which in "ab"} for _ in STARTS]
    sides = {which: side(args, which) for which in "ab"}
    for started, tallies in zip(STARTS, halves):
        first, second = started
        print(f"half {'AB'.index(first.upper()) + 1} of 2: {first.upper()} starts first", flush=True)
        with deployment(sides[first], str(cores[0]), str(cores[1]), pinned=True) as d1, \
                deployment(sides[second], str(cores[0]), str(cores[1]), pinned=True) as d2, \
                TandemClient(d1.address, timeout_s=3600) as c1, TandemClient(d2.address, timeout_s=3600) as c2:
            clients = {first: c1, second: c2}
            for client in clients.values():  # first-call costs, and the costs the orchestrators learn from
                for ids in prompts.values():
                    client.generate(prompt_ids=ids, max_tokens=16)
            order = ["a", "b"]
            for n in range(args.rounds):
                for name, ids in prompts.items():
                    for mode, params in modes:
                        for which in list(order):
                            print(f"{first.upper()} first, pass {n + 1}, {name}: {mode} on {which.upper()} …",
                                  flush=True)
                            tallies[which][mode].time(clients[which], name, ids, args.new_tokens, **params)
                        order.reverse()
    results = [{which: {mode: tally.result() for mode, tally in by_mode.items()} for which, by_mode in tallies.items()}
               for tallies in halves]
    ratio = {mode: [r["b"][mode].tok_s / r["a"][mode].tok_s for r in results] for mode, _ in modes}
    payload = {
        "sides": {which: {"target_args": flags.target_args, "draft_args": flags.draft_args,
                          "orchestrator_args": flags.orchestrator_args} for which, flags in sides.items()},
        "halves": [{"started_first": started[0], "modes": {which: {mode: _fields(r) for mode, r in result[which].items()}
                                                              for which in "ab"}}
                   for started, result in zip(STARTS, results)],
        # B over A in each half, and their geometric mean: what the setting does,
        # with the bias of the deployment started second cancelled out.
        "b_over_a_tok_s_per_half": ratio,
        "b_over_a_tok_s": {mode: math.sqrt(r[0] * r[1]) for mode, r in ratio.items()},
        # How much faster the deployment started second ran, whatever its setting.
        "second_over_first_tok_s": {mode: math.sqrt(r[0] / r[1]) for mode, r in ratio.items()},
        "same_tokens": {mode: sum(r["a"][mode].outputs[p] == r["b"][mode].outputs[p] for r in results for p in prompts)
                        for mode, _ in modes},
        "prompts": list(prompts), "new_tokens": args.new_tokens, "rounds": args.rounds, "dtype": args.dtype,
    }
    write(Path(args.out), payload)
    print(f"{'mode':<22} {'B/A, A first':>13} {'B/A, B first':>13} {'B/A':>7} {'2nd/1st':>8} {'same':>6}")
    for mode, _ in modes:
        r = ratio[mode]
        print(f"{mode:<22} {r[0]:13.4f} {r[1]:13.4f} {payload['b_over_a_tok_s'][mode]:7.4f} "
              f"{payload['second_over_first_tok_s'][mode]:8.4f} {payload['same_tokens'][mode]:>3}/{2 * len(prompts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
