"""What replicas of the target give under concurrent requests (README:
"Replicas of the model services"): two orchestrators in front of the same
processes, one given one target (--target A), the other two (--target A,B),
both the same draft. Each is sent the same greedy requests by C concurrent
clients, for each C; side by side in one run, the order of the sides rotating
from round to round. The second target sits idle while the first side runs.

For each side and C it records the tokens per second of all streams together
(tokens over the wall time of the round of requests), how the two-target side
spread its sessions (each target's calls), and whether every reply equals the
one-target side's.

    python -m bench.replica_probe                       # 2 and 4 clients, the default pair
    python -m bench.replica_probe --clients 1,2,4,8 --repeat 2 --reps 3

Writes bench/results/replica_probe.json."""
from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
from pathlib import Path

import grpc

from bench.batch_probe import _round, round_args, round_flags
from bench.common import RESULTS, cut, machine, pair_flags, parse_args, write
from tandem.launch import Service
from tandem.redis_local import ensure_redis
from tandem.v1 import common_pb2, target_pb2_grpc

log = logging.getLogger("bench.replica_probe")
SIDES = ("two_targets", "one_target")  # the reference last
LOG_DIR = Path.home() / ".cache" / "tandem" / "logs"


def _calls(service: Service) -> int:
    with grpc.insecure_channel(service.address) as channel:
        return target_pb2_grpc.TargetServiceStub(channel).GetStats(common_pb2.GetStatsRequest()).calls


def _started(stack: contextlib.ExitStack, service: Service) -> Service:
    service.start(LOG_DIR)
    stack.callback(service.stop)
    return service


def run(orchestrators: dict[str, Service], targets: list[Service], prompts: list[str], clients: list[int],
        new_tokens: int, reps: int) -> dict:
    rows = {side: {c: [] for c in clients} for side in SIDES}
    for orchestrator in orchestrators.values():  # warm-up
        _round(orchestrator.address, prompts[:1], 1, 8)
    for rep in range(reps):
        for i, c in enumerate(clients):
            turn = (rep * len(clients) + i) % len(SIDES)
            for side in SIDES[turn:] + SIDES[:turn]:
                before = [_calls(t) for t in targets]
                wall, replies = _round(orchestrators[side].address, prompts, c, new_tokens)
                calls = [_calls(t) - b for t, b in zip(targets, before)]
                tokens = sum(len(r) for r in replies)
                rows[side][c].append({"rep": rep, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
                                      "target_calls": calls, "replies": replies})
                log.info("%s, %d clients: %.2f tok/s, target calls %s", side, c, tokens / wall, calls)
    summary = {side: {str(c): {
        "tok_s": sum(r["tokens"] for r in rows[side][c]) / sum(r["wall_s"] for r in rows[side][c]),
        "tok_s_runs": [r["tok_s"] for r in rows[side][c]],
        "median_tok_s": statistics.median(r["tok_s"] for r in rows[side][c]),
        "target_calls": [sum(r["target_calls"][j] for r in rows[side][c]) for j in range(len(targets))],
    } for c in clients} for side in SIDES}
    return {
        "modes": summary,
        "reference": SIDES[-1],
        "over_reference": {str(c): summary[SIDES[0]][str(c)]["tok_s"] / summary[SIDES[-1]][str(c)]["tok_s"]
                           for c in clients},
        "identical_rounds": sum(a["replies"] == b["replies"] for c in clients
                                for a, b in zip(rows[SIDES[0]][c], rows[SIDES[-1]][c])),
        "rounds": reps * len(clients),
        "runs": {side: {str(c): [{k: v for k, v in r.items() if k != "replies"} for r in rows[side][c]]
                        for c in clients} for side in SIDES},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replica_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    pair_flags(parser)
    round_flags(parser, "2,4")
    parser.add_argument("--out", type=Path, default=RESULTS / "replica_probe.json", help="JSON output path")
    args = parse_args(parser, argv)
    clients, prompts = round_args(parser, args)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    common = ["--redis-url", ensure_redis(), "--prefix-cache", "0"]  # each request prefills its prompt
    with contextlib.ExitStack() as stack:
        targets = []
        for _ in range(2):  # one after the other: a target loading peaks at about 10 GiB (the default pair)
            targets.append(_started(stack, Service("target", ["--model", args.target], threads=args.threads)))
            targets[-1].ready(LOG_DIR, 900)
        draft = _started(stack, Service("draft", ["--model", args.draft, *args.draft_args.split()],
                                        threads=args.threads))
        draft.ready(LOG_DIR, 900)
        orchestrators = {}
        for side, listed in (("two_targets", targets), ("one_target", targets[:1])):
            orchestrators[side] = _started(stack, Service("orchestrator", [
                "--target", ",".join(t.address for t in listed), "--draft", draft.address, *common]))
            orchestrators[side].ready(LOG_DIR, 120)
        result = run(orchestrators, targets, prompts, clients, args.new_tokens, args.reps)
    result.update(target=args.target, draft=args.draft, draft_args=args.draft_args, repeat=args.repeat,
                  new_tokens=args.new_tokens, prompts=args.prompts.split(","), threads=args.threads,
                  machine=machine())
    write(args.out, result)
    print(f"{'clients':>7} {'two targets tok/s':>18} {'one target tok/s':>17}  ratio (cut)  two targets' calls (A, B)")
    for c in clients:
        two, one = result["modes"]["two_targets"][str(c)], result["modes"]["one_target"][str(c)]
        print(f"{c:>7} {two['tok_s']:18.2f} {one['tok_s']:17.2f}  {cut(result['over_reference'][str(c)]):10.2f}x"
              f"  {two['target_calls']}")
    print(f"rounds of requests whose replies equal one target's: {result['identical_rounds']}/{result['rounds']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
