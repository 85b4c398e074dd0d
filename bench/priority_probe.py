"""What a request's priority buys it on a busy target (README: "Priorities"):
one deployment of the pair run with --scheduling-policy priority, kept busy
by B background clients that send greedy requests of priority 5 back to
back. Meanwhile one foreground request goes out, in turn at priority -1
(urgent) and at priority 5 (the background's own: arrival order, as first
come, first served runs every call), side by side, the order of the sides
rotating from pass to pass.

For each side it records the foreground's time to its first token, its
wall time and tokens per second, the background's tokens per second over
the same window, and whether the foreground's tokens are the same on both
sides (priorities order calls, they change no token). Over the same window
it also reads each model service's GetStats: its busy share of the time
(busy_ms) and its calls per token streamed, foreground and background
together: where the time goes when one request jumps the queues.

    python -m bench.priority_probe                       # 3 background clients, 4 passes
    python -m bench.priority_probe --background 5 --reps 6

Writes bench/results/priority_probe.json."""
from __future__ import annotations

import argparse
import logging
import statistics
import threading
import time
from pathlib import Path

import grpc

from bench.common import PROMPTS, RESULTS, cut, machine, pair_deployment, pair_flags, pair_record, parse_args, write
from tandem.client import TandemClient
from tandem.redis_local import ensure_redis
from tandem.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

log = logging.getLogger("bench.priority_probe")
SIDES = {"urgent": -1, "same_as_background": 5}  # the foreground's priority; the reference last
BACKGROUND_PRIORITY = 5


def _background(address: str, clients: int, new_tokens: int, stop: threading.Event, tokens: list[int]):
    """`clients` threads that send greedy requests of BACKGROUND_PRIORITY one
    after another until `stop`; tokens[i]: client i's tokens so far, counted
    as they stream."""
    prompts = list(PROMPTS.values())

    def work(i: int):
        with TandemClient(address, timeout_s=900) as client:
            n = i
            while not stop.is_set():
                for event in client.generate_stream(prompts[n % len(prompts)], max_tokens=new_tokens,
                                                    temperature=0.0, priority=BACKGROUND_PRIORITY, ignore_eos=True):
                    if event.HasField("delta"):
                        tokens[i] += len(event.delta.token_ids)
                n += 1

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    return threads


def _foreground(address: str, prompt: str, new_tokens: int, priority: int) -> dict:
    start = time.perf_counter()
    first, ids = None, []
    with TandemClient(address, timeout_s=900) as client:
        for event in client.generate_stream(prompt, max_tokens=new_tokens, temperature=0.0, priority=priority,
                                            ignore_eos=True):
            if event.HasField("delta") and event.delta.token_ids:
                first = first if first is not None else time.perf_counter() - start
                ids.extend(event.delta.token_ids)
    wall = time.perf_counter() - start
    return {"ttft_s": first, "wall_s": wall, "tok_s": len(ids) / wall, "token_ids": ids}


def _service_counts(deployment) -> dict[str, tuple[int, int]]:
    """Each model service's (busy_ms, calls), from its GetStats."""
    counts = {}
    for role, service, stub in (("target", deployment.target, target_pb2_grpc.TargetServiceStub),
                                ("draft", deployment.draft, draft_pb2_grpc.DraftServiceStub)):
        with grpc.insecure_channel(service.address) as channel:
            stats = stub(channel).GetStats(common_pb2.GetStatsRequest(), timeout=30)
        counts[role] = (stats.busy_ms, stats.calls)
    return counts


def one_pass(deployment, prompt: str, background: int, new_tokens: int, foreground_tokens: int,
             priority: int, settle_s: float) -> dict:
    """The foreground request at `priority` while the background runs."""
    address = deployment.address
    stop, tokens = threading.Event(), [0] * background
    threads = _background(address, background, new_tokens, stop, tokens)
    time.sleep(settle_s)  # every background client has a request under way
    counts = _service_counts(deployment)
    before, start = sum(tokens), time.perf_counter()
    run = _foreground(address, prompt, foreground_tokens, priority)
    window = time.perf_counter() - start
    background_tokens = sum(tokens) - before
    after = _service_counts(deployment)
    run["background_tok_s"] = background_tokens / window  # all background streams, over the window
    streamed = background_tokens + len(run["token_ids"])
    for role, (busy_ms, calls) in after.items():
        run[f"{role}_busy_share"] = (busy_ms - counts[role][0]) / 1e3 / window
        run[f"{role}_calls_per_token"] = (calls - counts[role][1]) / max(streamed, 1)
    stop.set()
    for thread in threads:
        thread.join()
    return run


def run(deployment, prompt: str, background: int, new_tokens: int, foreground_tokens: int, reps: int,
        settle_s: float) -> dict:
    sides = list(SIDES)
    rows = {side: [] for side in sides}
    _foreground(deployment.address, prompt, 8, 0)  # warm-up
    for rep in range(reps):
        turn = rep % len(sides)
        for side in sides[turn:] + sides[:turn]:
            row = one_pass(deployment, prompt, background, new_tokens, foreground_tokens, SIDES[side], settle_s)
            rows[side].append({"rep": rep, **row})
            log.info("%s (priority %d): first token %.2f s, %.2f s, %.2f tok/s; background %.2f tok/s; busy: "
                     "target %.2f, draft %.2f; calls a token: target %.3f, draft %.3f", side, SIDES[side],
                     row["ttft_s"], row["wall_s"], row["tok_s"], row["background_tok_s"], row["target_busy_share"],
                     row["draft_busy_share"], row["target_calls_per_token"], row["draft_calls_per_token"])
    summary = {side: {
        "priority": SIDES[side],
        "median_ttft_s": statistics.median(r["ttft_s"] for r in rows[side]),
        "median_wall_s": statistics.median(r["wall_s"] for r in rows[side]),
        "tok_s": sum(len(r["token_ids"]) for r in rows[side]) / sum(r["wall_s"] for r in rows[side]),
        "background_tok_s": statistics.median(r["background_tok_s"] for r in rows[side]),
        **{f"median_{key}": statistics.median(r[key] for r in rows[side])
           for key in ("target_busy_share", "draft_busy_share", "target_calls_per_token", "draft_calls_per_token")},
    } for side in sides}
    reference = sides[-1]
    return {
        "modes": summary,
        "reference": reference,
        "urgent_over_reference": {
            "tok_s": summary[sides[0]]["tok_s"] / summary[reference]["tok_s"],
            "median_wall_s": summary[reference]["median_wall_s"] / summary[sides[0]]["median_wall_s"],
            "median_ttft_s": summary[reference]["median_ttft_s"] / summary[sides[0]]["median_ttft_s"],
        },
        "identical_foregrounds": sum(a["token_ids"] == b["token_ids"]
                                     for a, b in zip(rows[sides[0]], rows[reference])),
        "passes": reps,
        "runs": {side: [{k: v for k, v in r.items() if k != "token_ids"} for r in rows[side]] for side in sides},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.priority_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    pair_flags(parser)
    parser.add_argument("--background", type=int, default=3, help="background clients (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="tokens of each background request (default: %(default)s)")
    parser.add_argument("--foreground-tokens", type=int, default=32,
                        help="tokens of the foreground request (default: %(default)s)")
    parser.add_argument("--prompt", default="code-1", choices=sorted(PROMPTS),
                        help="the foreground's prompt (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=4, help="passes, each side once a pass (default: %(default)s)")
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds the background runs before the foreground goes (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per service (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS / "priority_probe.json", help="JSON output path")
    args = parse_args(parser, argv)
    if args.background < 1 or args.reps < 1:
        parser.error("--background and --reps must be >= 1")
    deployment = pair_deployment(args, ["--redis-url", ensure_redis(), "--prefix-cache", "0",
                                        "--scheduling-policy", "priority"])
    with deployment:
        result = run(deployment, PROMPTS[args.prompt], args.background, args.new_tokens,
                     args.foreground_tokens, args.reps, args.settle)
    result.update(**pair_record(args), background=args.background,
                  background_priority=BACKGROUND_PRIORITY, new_tokens=args.new_tokens,
                  foreground_tokens=args.foreground_tokens, prompt=args.prompt, threads=args.threads,
                  machine=machine())
    write(args.out, result)
    print(f"{'foreground':>20} {'priority':>8} {'first token s':>14} {'wall s':>8} {'tok/s':>7} {'background tok/s':>17}")
    for side, mode in result["modes"].items():
        print(f"{side:>20} {mode['priority']:>8} {mode['median_ttft_s']:14.2f} {mode['median_wall_s']:8.2f} "
              f"{mode['tok_s']:7.2f} {mode['background_tok_s']:17.2f}")
    print(f"{'foreground':>20} {'target busy':>11} {'draft busy':>10} {'target calls/token':>18} "
          f"{'draft calls/token':>17}   (medians, over the foreground's window)")
    for side, mode in result["modes"].items():
        print(f"{side:>20} {cut(mode['median_target_busy_share']):11.2f} {cut(mode['median_draft_busy_share']):10.2f} "
              f"{mode['median_target_calls_per_token']:18.3f} {mode['median_draft_calls_per_token']:17.3f}")
    ratio = result["urgent_over_reference"]
    print(f"urgent over same-as-background (cut): {cut(ratio['tok_s']):.2f}x tok/s, "
          f"{cut(ratio['median_wall_s']):.2f}x shorter wall, {cut(ratio['median_ttft_s']):.2f}x sooner first token")
    print(f"foregrounds identical on both sides: {result['identical_foregrounds']}/{result['passes']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
