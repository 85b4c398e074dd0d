"""What batching across sessions gives under concurrent requests: deployments
of the same pair, up at once, that batch in different places (--sides):
both_batched (the target batches the verifies that queue, --batch-verifies N,
and the draft the greedy blocks that queue, --batch-drafts M), target_batched
(the target alone), unbatched. Each is sent the same greedy requests by C
concurrent clients, for each C; side by side in one run, the order of the
sides rotating from round to round.

For each side and C it records the tokens per second of all streams together
(tokens over the wall time of the round of requests), the services' batches
and the calls they held, and whether every reply equals the last side's (the
reference of the ratios too).

    python -m bench.batch_probe                        # the draft's batching: both_batched,target_batched
    python -m bench.batch_probe --sides target_batched,unbatched --clients 1,2,3,4 --reps 3
    python -m bench.batch_probe --clients 4,8 --repeat 2 --batch 8 --batch-drafts 8   # 8 streams

Three sides of the default pair do not fit in 24 GiB (a target peaks at about
6 GiB while it loads). Writes bench/results/batch_probe.json."""
from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import threading
import time
from pathlib import Path

import grpc

from bench.common import PROMPTS, RESULTS, cut, machine, model_flags, pair_flags, pair_record, parse_args, write
from tandem.client import TandemClient
from tandem.launch import Deployment, Service
from tandem.redis_local import ensure_redis
from tandem.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

log = logging.getLogger("bench.batch_probe")
SIDES = ("both_batched", "target_batched", "unbatched")


def _round(address: str | list[str], prompts: list[str], clients: int,
           new_tokens: int) -> tuple[float, list[list[int]]]:
    """Each of `clients` threads sends its share of the prompts, one after
    another; returns the wall time and the replies' tokens, in prompt order.
    Several addresses (orchestrators): client i sends to the i-th, in turn."""
    addresses = [address] if isinstance(address, str) else address
    replies: list[list[int] | None] = [None] * len(prompts)
    errors: list[BaseException] = []

    def work(worker: int):
        try:
            with TandemClient(addresses[worker % len(addresses)], timeout_s=900) as client:
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


COUNTS = ("verify_batches", "batched_verifies", "draft_batches", "batched_drafts")


def _counts(deployment: Deployment) -> dict[str, int]:
    """The batches and the calls they held, of the deployment's target and draft."""
    counts = {}
    for service, stub in ((deployment.target, target_pb2_grpc.TargetServiceStub),
                          (deployment.draft, draft_pb2_grpc.DraftServiceStub)):
        with grpc.insecure_channel(service.address) as channel:
            stats = stub(channel).GetStats(common_pb2.GetStatsRequest())
        counts.update({key: getattr(stats, key) for key in COUNTS if getattr(stats, key)})
    return {key: counts.get(key, 0) for key in COUNTS}


def round_flags(parser, clients: str) -> None:
    """The flags of a round of requests from concurrent clients (_round), and --threads."""
    parser.add_argument("--clients", default=clients, help="concurrent clients, each run (default: %(default)s)")
    parser.add_argument("--prompts", default=",".join(PROMPTS), help="prompt names (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per request (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=2, help="passes (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="each prompt sent this many times a round, as requests of their own: more "
                             "streams than prompts (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per service (default: %(default)s)")


def round_args(parser, args) -> tuple[list[int], list[str]]:
    """The client counts and a round's prompts, from round_flags' flags."""
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    return [int(c) for c in args.clients.split(",")], [PROMPTS[name] for name in args.prompts.split(",")] * args.repeat


def _per_batch(runs: list[dict], calls: str, batches: str) -> float:
    done = sum(r[batches] for r in runs)
    return sum(r[calls] for r in runs) / done if done else 0.0


def run(deployments: dict, prompts: list[str], clients: list[int], new_tokens: int, reps: int) -> dict:
    """deployments: by side, the reference last; each round of requests goes
    to every side, in an order that rotates from round to round."""
    sides = list(deployments)
    reference = sides[-1]
    rows = {side: {c: [] for c in clients} for side in sides}
    for side, deployment in deployments.items():  # warm-up
        _round(deployment.address, prompts[:1], 1, 8)
    for rep in range(reps):
        for i, c in enumerate(clients):
            turn = (rep * len(clients) + i) % len(sides)
            for side in sides[turn:] + sides[:turn]:
                deployment = deployments[side]
                before = _counts(deployment)
                wall, replies = _round(deployment.address, prompts, c, new_tokens)
                after = _counts(deployment)
                tokens = sum(len(r) for r in replies)
                rows[side][c].append({"rep": rep, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
                                      **{key: after[key] - before[key] for key in COUNTS}, "replies": replies})
                log.info("%s, %d clients: %.2f tok/s", side, c, tokens / wall)
    summary = {side: {} for side in sides}
    for side in sides:
        for c in clients:
            runs = rows[side][c]
            summary[side][str(c)] = {
                "tok_s": sum(r["tokens"] for r in runs) / sum(r["wall_s"] for r in runs),
                "tok_s_runs": [r["tok_s"] for r in runs],
                "verifies_per_batch": _per_batch(runs, "batched_verifies", "verify_batches"),
                "drafts_per_batch": _per_batch(runs, "batched_drafts", "draft_batches"),
            }
    return {
        "modes": summary,
        "reference": reference,
        "over_reference": {side: {str(c): summary[side][str(c)]["tok_s"] / summary[reference][str(c)]["tok_s"]
                                  for c in clients} for side in sides[:-1]},
        "identical_rounds": {side: sum(a["replies"] == b["replies"] for c in clients
                                       for a, b in zip(rows[side][c], rows[reference][c]))
                             for side in sides[:-1]},
        "rounds": reps * len(clients),
        "median_tok_s": {side: {str(c): statistics.median(summary[side][str(c)]["tok_s_runs"]) for c in clients}
                         for side in sides},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.batch_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    pair_flags(parser)
    parser.add_argument("--batch", type=int, default=4, help="the batched sides' --batch-verifies (default: %(default)s)")
    parser.add_argument("--batch-drafts", type=int, default=4,
                        help="both_batched's --batch-drafts (default: %(default)s)")
    parser.add_argument("--sides", default="both_batched,target_batched",
                        help=f"two or more of {', '.join(SIDES)}, the reference last (default: %(default)s)")
    round_flags(parser, "1,2,4")
    parser.add_argument("--out", type=Path, default=RESULTS / "batch_probe.json", help="JSON output path")
    args = parse_args(parser, argv)
    clients, prompts = round_args(parser, args)
    orchestrator = ["--redis-url", ensure_redis(), "--prefix-cache", "0"]  # each request prefills its prompt

    def deployment(batch: int, batch_drafts: int) -> Deployment:
        return Deployment(Service("target", [*model_flags(args, "target"), "--batch-verifies", str(batch)],
                                  threads=args.threads),
                          Service("draft", [*model_flags(args, "draft"), "--batch-drafts", str(batch_drafts)],
                                  threads=args.threads),
                          orchestrator)

    sides = args.sides.split(",")
    if len(sides) < 2 or len(set(sides)) < len(sides) or not set(sides) <= set(SIDES):
        parser.error(f"--sides: two or more distinct of {', '.join(SIDES)}, got {args.sides!r}")
    plan = {"both_batched": (args.batch, args.batch_drafts), "target_batched": (args.batch, 1), "unbatched": (1, 1)}
    plans = {side: plan[side] for side in sides}
    with contextlib.ExitStack() as stack:
        deployments = {side: stack.enter_context(deployment(*plan)) for side, plan in plans.items()}
        result = run(deployments, prompts, clients, args.new_tokens, args.reps)
    result.update(**pair_record(args), batch=args.batch,
                  batch_drafts=args.batch_drafts, sides=sides, repeat=args.repeat, new_tokens=args.new_tokens, prompts=args.prompts.split(","),
                  machine=machine())
    write(args.out, result)
    print(f"{'clients':>7} " + " ".join(f"{side + ' tok/s':>22}" for side in sides) + f"  over {sides[-1]} (cut)"
          + "  verifies / drafts a batch")
    for c in clients:
        modes = [result["modes"][side][str(c)] for side in sides]
        ratios = ", ".join(f"{cut(result['over_reference'][side][str(c)]):.2f}x" for side in sides[:-1])
        batches = ", ".join(f"{m['verifies_per_batch']:.2f} / {m['drafts_per_batch']:.2f}" for m in modes[:-1])
        print(f"{c:>7} " + " ".join(f"{m['tok_s']:22.2f}" for m in modes) + f"  {ratios:>20}  {batches}")
    same = ", ".join(f"{side} {n}/{result['rounds']}" for side, n in result["identical_rounds"].items())
    print(f"rounds of requests whose replies equal {sides[-1]}'s: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
