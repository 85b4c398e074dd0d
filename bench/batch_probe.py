"""What the target's --batch-verifies gives under concurrent requests: two
deployments of the same pair, one whose target batches the verifies that
queue (--batch-verifies N) and one whose target does not, each sent the same
greedy requests by C concurrent clients, for each C; side by side in one run,
alternating which goes first.

For each side and C it records the tokens per second of all streams together
(tokens over the wall time of the round of requests), the target's batched
forwards, and whether every reply equals the other side's.

    python -m bench.batch_probe                        # the default pair, C = 1, 2, 4, 64 tokens
    python -m bench.batch_probe --clients 1,2,3,4 --reps 3

Writes bench/results/batch_probe.json."""
from __future__ import annotations

import argparse
import logging
import statistics
import threading
import time
from pathlib import Path

import grpc

from bench.common import PROMPTS, RESULTS, cut, machine, parse_args, write
from tandem.client import TandemClient
from tandem.launch import Deployment, Service
from tandem.redis_local import ensure_redis
from tandem.v1 import common_pb2, target_pb2_grpc

log = logging.getLogger("bench.batch_probe")
SIDES = ("batched", "unbatched")


def _round(address: str, prompts: list[str], clients: int, new_tokens: int) -> tuple[float, list[list[int]]]:
    """Each of `clients` threads sends its share of the prompts, one after
    another; returns the wall time and the replies' tokens, in prompt order."""
    replies: list[list[int] | None] = [None] * len(prompts)
    errors: list[BaseException] = []

    def work(worker: int):
        try:
            with TandemClient(address, timeout_s=900) as client:
                for i in range(worker, len(prompts), clients):
                    replies[i] = client.generate(prompts[i], max_tokens=new_tokens, temperature=0.0).token_ids
        except BaseException as err:  # reported below, in the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start, replies


def _target_counts(address: str) -> tuple[int, int]:
    with grpc.insecure_channel(address) as channel:
        stats = target_pb2_grpc.TargetServiceStub(channel).GetStats(common_pb2.GetStatsRequest())
    return stats.verify_batches, stats.batched_verifies


def run(deployments: dict, prompts: list[str], clients: list[int], new_tokens: int, reps: int) -> dict:
    rows = {side: {c: [] for c in clients} for side in SIDES}
    for side, deployment in deployments.items():  # warm-up
        _round(deployment.address, prompts[:1], 1, 8)
    for rep in range(reps):
        for c in clients:
            order = SIDES if (rep + c) % 2 == 0 else SIDES[::-1]
            for side in order:
                deployment = deployments[side]
                before = _target_counts(deployment.target.address)
                wall, replies = _round(deployment.address, prompts, c, new_tokens)
                after = _target_counts(deployment.target.address)
                tokens = sum(len(r) for r in replies)
                rows[side][c].append({"rep": rep, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
                                      "verify_batches": after[0] - before[0],
                                      "batched_verifies": after[1] - before[1], "replies": replies})
                log.info("%s, %d clients: %.2f tok/s", side, c, tokens / wall)
    summary = {side: {} for side in SIDES}
    for side in SIDES:
        for c in clients:
            runs = rows[side][c]
            summary[side][str(c)] = {
                "tok_s": sum(r["tokens"] for r in runs) / sum(r["wall_s"] for r in runs),
                "tok_s_runs": [r["tok_s"] for r in runs],
                "verifies_per_batch": (sum(r["batched_verifies"] for r in runs) / sum(r["verify_batches"] for r in runs)
                                       if any(r["verify_batches"] for r in runs) else 0.0),
            }
    identical = sum(a["replies"] == b["replies"] for c in clients
                    for a, b in zip(rows["batched"][c], rows["unbatched"][c]))
    return {
        "modes": summary,
        "batched_over_unbatched": {str(c): summary["batched"][str(c)]["tok_s"] / summary["unbatched"][str(c)]["tok_s"]
                                   for c in clients},
        "identical_rounds": identical,
        "rounds": reps * len(clients),
        "median_tok_s": {side: {str(c): statistics.median(summary[side][str(c)]["tok_s_runs"]) for c in clients}
                         for side in SIDES},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.batch_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="default-target", help="target model (default: %(default)s)")
    parser.add_argument("--draft", default="default-draft", help="draft model (default: %(default)s)")
    parser.add_argument("--draft-args", default="--quantize auto --vocab-subset 32768",
                        help="extra draft service flags (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=4, help="the batched side's --batch-verifies (default: %(default)s)")
    parser.add_argument("--clients", default="1,2,4", help="concurrent clients, each run (default: %(default)s)")
    parser.add_argument("--prompts", default=",".join(PROMPTS), help="prompt names (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per request (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=2, help="passes (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per service (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS / "batch_probe.json", help="JSON output path")
    args = parse_args(parser, argv)
    clients = [int(c) for c in args.clients.split(",")]
    prompts = [PROMPTS[name] for name in args.prompts.split(",")]
    orchestrator = ["--redis-url", ensure_redis(), "--prefix-cache", "0"]  # each request prefills its prompt

    def deployment(batch: int) -> Deployment:
        return Deployment(Service("target", ["--model", args.target, "--batch-verifies", str(batch)],
                                  threads=args.threads),
                          Service("draft", ["--model", args.draft, *args.draft_args.split()], threads=args.threads),
                          orchestrator)

    with deployment(args.batch) as batched, deployment(1) as unbatched:
        result = run({"batched": batched, "unbatched": unbatched}, prompts, clients, args.new_tokens, args.reps)
    result.update(target=args.target, draft=args.draft, draft_args=args.draft_args, batch=args.batch,
                  new_tokens=args.new_tokens, prompts=args.prompts.split(","), machine=machine())
    write(args.out, result)
    print(f"{'clients':>7} {'batched tok/s':>14} {'unbatched tok/s':>16} {'ratio (cut)':>12} {'verifies a batch':>17}")
    for c in clients:
        on, off = result["modes"]["batched"][str(c)], result["modes"]["unbatched"][str(c)]
        print(f"{c:>7} {on['tok_s']:14.2f} {off['tok_s']:16.2f} {cut(result['batched_over_unbatched'][str(c)]):11.2f}x "
              f"{on['verifies_per_batch']:17.2f}")
    print(f"same replies on both sides: {result['identical_rounds']}/{result['rounds']} rounds of requests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
