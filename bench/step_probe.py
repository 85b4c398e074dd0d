"""What one draft step and one verify cost, each path side by side in one run:
the draft model's one-token step through Hugging Face's forward (`hf`), the lean
forward (`lean`, tandem/lean.py) and, on a GPU, the lean step replayed
from a CUDA graph (`graph`); the target's forward of 1 and of k + 1 tokens
through Hugging Face's forward (`target_forward`), and on a GPU replayed from a
CUDA graph of the lean forward (`target_forward_graph`), as target_service runs
it with --graphs off and on.

Each step is timed as the drafter takes it: the forward, then the greedy token
read back to the host (a GPU sync). The draft is the model as it loads, not
quantized (the draft service quantizes it on a CPU). Every path is fed `hf`'s
greedy tokens, so that each step sees the same history, and its greedy token
at each step is compared with `hf`'s (`same_tokens_as_hf`) along with the
largest difference of their logits (`max_abs_logit_diff_vs_hf`): bf16 paths may
part at near-ties, which the target's verify absorbs.

    python -m bench.step_probe                                  # the default pair on the CPU
    python -m bench.step_probe --device cuda --target T --draft D

Writes bench/results/step_probe.json."""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import RESULTS, machine, parse_args, write

log = logging.getLogger("bench.step_probe")

PROMPT_LEN = 48


def prompt(vocab_size: int) -> list[int]:
    """Fixed ids below the vocabulary's size: no tokenizer needed."""
    span = min(vocab_size, 5000)
    return [(37 * i + 11) % (span - 1) + 1 for i in range(PROMPT_LEN)]


def draft_steps(runner, steps: int, warmups: int, feed: list[int] | None = None):
    """Prefills the prompt, then one-token steps (warm-ups first), each fed the
    greedy token of the step before or, given `feed`, feed's token at its
    place. Returns the ms of each timed step, the tokens fed (warm-ups
    included), the greedy tokens and the float32 logits (on the host) of the
    timed steps."""
    kv = runner.new_cache()
    logits = runner.forward(kv, prompt(runner.loaded.vocab_size), logits_to_keep=1)[0]
    token = int(logits.argmax())
    times, fed, tokens, kept = [], [], [], []
    for i in range(warmups + steps):
        if feed is not None:
            token = feed[i]
        fed.append(token)
        start = time.perf_counter()
        logits = runner.forward(kv, [token], logits_to_keep=1)[0]
        token = int(logits.argmax())
        elapsed = (time.perf_counter() - start) * 1e3
        if i >= warmups:
            times.append(elapsed)
            tokens.append(token)
            kept.append(logits.cpu())
    return times, fed, tokens, torch.stack(kept)


def verify_forwards(runner, count: int, reps: int, warmups: int) -> list[float]:
    """ms of a forward of `count` tokens (all their logits, as a verify) on a
    cache held at the prompt's length."""
    kv = runner.new_cache()
    ids = prompt(runner.loaded.vocab_size)
    runner.forward(kv, ids, logits_to_keep=1)
    block = ids[:count]
    times = []
    for i in range(warmups + reps):
        start = time.perf_counter()
        runner.forward(kv, block, logits_to_keep=count).argmax(dim=-1).tolist()
        elapsed = (time.perf_counter() - start) * 1e3
        kv.crop(-count)
        if i >= warmups:
            times.append(elapsed)
    return times


def summary(times: list[float]) -> dict:
    deciles = statistics.quantiles(times, n=10)
    return {"median_ms": statistics.median(times), "p10_ms": deciles[0], "p90_ms": deciles[-1], "n": len(times)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="default-target", help="target model (default: %(default)s)")
    parser.add_argument("--draft", default="default-draft", help="draft model (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="auto = what a model service picks (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=64, help="timed draft steps per path (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=32, help="timed target forwards per size (default: %(default)s)")
    parser.add_argument("--warmups", type=int, default=5, help="untimed runs before each (default: %(default)s)")
    parser.add_argument("--verify-tokens", default="1,4", help="target forward sizes, comma-separated (default: %(default)s)")
    parser.add_argument("--skip-target", action="store_true", help="time the draft paths only")
    parser.add_argument("--out", type=Path, default=RESULTS / "step_probe.json", help="JSON output path")
    args = parse_args(parser, argv)
    if args.steps < 2 or args.reps < 2:
        parser.error("--steps and --reps must be at least 2")

    from tandem.lean import MAX_STATIC_ROWS, LeanRunner, unsupported
    from tandem.modeling import ModelConfig, ModelRunner, load, use_gpu_host_settings

    device = torch.device(args.device)
    if device.type == "cuda":
        use_gpu_host_settings()  # as the services do
    draft = load(ModelConfig(args.draft, device=args.device, dtype=args.dtype))
    paths = {"hf": ModelRunner(draft, args.device)}
    reason = unsupported(draft.model)
    if reason is None:
        paths["lean"] = LeanRunner(draft, args.device, fused=False)
        if device.type == "cuda":
            paths["graph"] = LeanRunner(draft, args.device, fused=False, graphs=True)
    else:
        log.info("no lean paths: %s", reason)
    result = {"machine": machine(), "device": args.device, "dtype": str(draft.model.dtype).removeprefix("torch."),
              "target": args.target, "draft": args.draft, "draft_step": {}, "target_forward": {}}
    fed = reference = reference_logits = None
    for name, runner in paths.items():
        times, fed, tokens, logits = draft_steps(runner, args.steps, args.warmups, feed=fed)
        entry = summary(times)
        if reference is None:
            reference, reference_logits = tokens, logits
        else:
            entry["same_tokens_as_hf"] = sum(a == b for a, b in zip(tokens, reference))
            entry["max_abs_logit_diff_vs_hf"] = float((logits - reference_logits).abs().max())
        result["draft_step"][name] = entry
        log.info("draft step, %s: %.2f ms median", name, entry["median_ms"])
    del paths, draft
    if not args.skip_target:
        target = load(ModelConfig(args.target, device=args.device, dtype=args.dtype))
        runners = {"target_forward": ModelRunner(target, args.device)}
        if device.type == "cuda" and unsupported(target.model) is None:  # the target service's --graphs
            runners["target_forward_graph"] = LeanRunner(target, args.device, fused=False, graphs=True,
                                                         static_rows=MAX_STATIC_ROWS)
        counts = [int(c) for c in args.verify_tokens.split(",")]
        for key, runner in runners.items():
            result[key] = {}
            for count in counts:
                entry = summary(verify_forwards(runner, count, args.reps, args.warmups))
                result[key][str(count)] = entry
                log.info("%s of %d tokens: %.2f ms median", key, count, entry["median_ms"])
        # A verify of the longest block, as the target service runs it by default (graphed on a GPU).
        result["verify_path"] = key = "target_forward_graph" if "target_forward_graph" in result else "target_forward"
        verify = result[key][str(max(counts))]["median_ms"]
        result["draft_step_over_verify"] = {name: e["median_ms"] / verify for name, e in result["draft_step"].items()}
    write(args.out, result)
    print(f"{'path':<26}{'median ms':>10}{'p10':>8}{'p90':>8}")
    for name, entry in result["draft_step"].items():
        print(f"{'draft step, ' + name:<26}{entry['median_ms']:>10.2f}{entry['p10_ms']:>8.2f}{entry['p90_ms']:>8.2f}")
    for key, how in (("target_forward", "target"), ("target_forward_graph", "target, graph")):
        for count, entry in result.get(key, {}).items():
            print(f"{how + ', ' + count + ' tokens':<26}{entry['median_ms']:>10.2f}{entry['p10_ms']:>8.2f}"
                  f"{entry['p90_ms']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
