"""What replicas of the target give under concurrent requests (README:
"Replicas of the model services"), in one of two comparisons, side by side in
one run, the order of the sides rotating from round to round. Each side is
sent the same greedy requests by C concurrent clients, for each C.

--compare replicas (the default): two orchestrators in front of the same
processes, one given one target (--target A), the other two (--target A,B),
both the same draft. The second target sits idle while the first side runs.

--compare load: two pairs of orchestrators, every one given both targets;
the clients take turns over the pair's two orchestrators. One pair shares its
sessions per target through Redis (--replica-load-interval 1), the other does
not (0): each of its orchestrators places new sessions by its own alone.

For each side and C it records the tokens per second of all streams together
(tokens over the wall time of the round of requests), how the sessions were
spread (each target's calls, and the busier target's share of them, each
round), and whether every reply equals the reference side's (the last). With
--compare load it also samples, every SAMPLE_S, each orchestrator's sessions
on each target (its tandem_replica_sessions gauge): of the samples with two
sessions or more running, the share in which one target held more than half
of them, rounded up ("crowded"), where the other could have taken one.

    python -m bench.replica_probe                       # 2 and 4 clients, the default pair
    python -m bench.replica_probe --clients 1,2,4,8 --repeat 2 --reps 3
    python -m bench.replica_probe --compare load --clients 2,4 --repeat 2

Writes bench/results/replica_probe.json (or replica_load_probe.json)."""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import statistics
import threading
import urllib.request
from pathlib import Path

import grpc

from bench.batch_probe import _round, round_args, round_flags
from bench.common import RESULTS, cut, machine, model_flags, pair_flags, pair_record, parse_args, write
from tandem.launch import Service, free_port
from tandem.redis_local import ensure_redis
from tandem.v1 import common_pb2, target_pb2_grpc

log = logging.getLogger("bench.replica_probe")
SIDES = {"replicas": ("two_targets", "one_target"),  # the reference last
         "load": ("shared_loads", "own_loads")}
LOG_DIR = Path.home() / ".cache" / "tandem" / "logs"
SAMPLE_S = 0.2  # how often the orchestrators' sessions per target are sampled (--compare load)


def _calls(service: Service) -> int:
    with grpc.insecure_channel(service.address) as channel:
        return target_pb2_grpc.TargetServiceStub(channel).GetStats(common_pb2.GetStatsRequest()).calls


def _sessions(metrics_urls: list[str]) -> dict[str, int]:
    """Every orchestrator's sessions on each target, summed: their
    tandem_replica_sessions{service="target"} gauges."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, int] = {}
    for url in metrics_urls:
        with urllib.request.urlopen(url, timeout=5) as answer:
            text = answer.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name == "tandem_replica_sessions":
                for sample in family.samples:
                    if sample.labels.get("service") == "target":
                        replica = sample.labels["replica"]
                        totals[replica] = totals.get(replica, 0) + int(sample.value)
    return totals


class _Sampler:
    """Samples _sessions every SAMPLE_S on a thread of its own, while in a with block."""

    def __init__(self, metrics_urls: list[str]):
        self.urls, self.samples, self.errors = metrics_urls, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            try:
                self.samples.append(sorted(_sessions(self.urls).values()))
            except OSError:
                self.errors += 1

    def __enter__(self):
        if self.urls:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.urls:
            self._thread.join(10)

    def crowded(self) -> tuple[float | None, int]:
        """Of the samples with two sessions or more, the share in which one
        target held more than half of them rounded up; and how many such samples."""
        busy = [s for s in self.samples if sum(s) >= 2]
        if not busy:
            return None, 0
        return sum(max(s) > math.ceil(sum(s) / 2) for s in busy) / len(busy), len(busy)


def _started(stack: contextlib.ExitStack, service: Service) -> Service:
    service.start(LOG_DIR)
    stack.callback(service.stop)
    return service


def _pooled(runs: list[dict]) -> float | None:
    busy = sum(r["busy_samples"] for r in runs)
    return sum(r["crowded_share"] * r["busy_samples"] for r in runs if r["busy_samples"]) / busy if busy else None


def run(orchestrators: dict[str, list[Service]], targets: list[Service], prompts: list[str], clients: list[int],
        new_tokens: int, reps: int, metrics: dict[str, list[str]] | None = None) -> dict:
    """orchestrators: each side's, the reference side last; metrics: each
    side's orchestrators' /metrics URLs, to sample their sessions per target."""
    metrics = metrics or {}
    sides = list(orchestrators)
    rows = {side: {c: [] for c in clients} for side in sides}
    for group in orchestrators.values():  # warm-up
        for orchestrator in group:
            _round(orchestrator.address, prompts[:1], 1, 8)
    for rep in range(reps):
        for i, c in enumerate(clients):
            turn = (rep * len(clients) + i) % len(sides)
            for side in sides[turn:] + sides[:turn]:
                before = [_calls(t) for t in targets]
                with _Sampler(metrics.get(side, [])) as sampler:
                    wall, replies = _round([o.address for o in orchestrators[side]], prompts, c, new_tokens)
                calls = [_calls(t) - b for t, b in zip(targets, before)]
                tokens = sum(len(r) for r in replies)
                crowded, busy_samples = sampler.crowded()
                rows[side][c].append({"rep": rep, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
                                      "target_calls": calls, "busier_share": max(calls) / max(sum(calls), 1),
                                      "crowded_share": crowded, "busy_samples": busy_samples,
                                      "samples": len(sampler.samples), "sample_errors": sampler.errors,
                                      "replies": replies})
                log.info("%s, %d clients: %.2f tok/s, target calls %s, crowded in %s of %d samples", side, c,
                         tokens / wall, calls, "-" if crowded is None else f"{crowded:.2f}", busy_samples)
    summary = {side: {str(c): {
        "tok_s": sum(r["tokens"] for r in rows[side][c]) / sum(r["wall_s"] for r in rows[side][c]),
        "tok_s_runs": [r["tok_s"] for r in rows[side][c]],
        "median_tok_s": statistics.median(r["tok_s"] for r in rows[side][c]),
        "target_calls": [sum(r["target_calls"][j] for r in rows[side][c]) for j in range(len(targets))],
        "busier_share_runs": [r["busier_share"] for r in rows[side][c]],
        "busier_share_mean": statistics.fmean(r["busier_share"] for r in rows[side][c]),
        # over every sample of the side's rounds (with two sessions or more), not a mean of the rounds' shares
        "crowded_share": _pooled(rows[side][c]),
    } for c in clients} for side in sides}
    return {
        "modes": summary,
        "reference": sides[-1],
        "over_reference": {str(c): summary[sides[0]][str(c)]["tok_s"] / summary[sides[-1]][str(c)]["tok_s"]
                           for c in clients},
        "identical_rounds": sum(a["replies"] == b["replies"] for c in clients
                                for a, b in zip(rows[sides[0]][c], rows[sides[-1]][c])),
        "rounds": reps * len(clients),
        "runs": {side: {str(c): [{k: v for k, v in r.items() if k != "replies"} for r in rows[side][c]]
                        for c in clients} for side in sides},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replica_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    pair_flags(parser)
    round_flags(parser, "2,4")
    parser.add_argument("--compare", choices=sorted(SIDES), default="replicas",
                        help="replicas: two targets against one; load: orchestrators sharing their loads "
                             "against not (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON output path (default: bench/results/replica_probe.json, or "
                             "replica_load_probe.json with --compare load)")
    args = parse_args(parser, argv)
    out = args.out or RESULTS / ("replica_load_probe.json" if args.compare == "load" else "replica_probe.json")
    clients, prompts = round_args(parser, args)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    common = ["--redis-url", ensure_redis(), "--prefix-cache", "0"]  # each request prefills its prompt
    with contextlib.ExitStack() as stack:
        targets = []
        for _ in range(2):  # one after the other: a target loading peaks at about 10 GiB (the default pair)
            targets.append(_started(stack, Service("target", model_flags(args, "target"), threads=args.threads)))
            targets[-1].ready(LOG_DIR, 900)
        draft = _started(stack, Service("draft", model_flags(args, "draft"), threads=args.threads))
        draft.ready(LOG_DIR, 900)
        both = ",".join(t.address for t in targets)
        if args.compare == "replicas":
            groups = {"two_targets": [("--target", both)], "one_target": [("--target", targets[0].address)]}
        else:
            groups = {side: [("--target", both, "--replica-load-interval", interval,
                              "--metrics-port", str(free_port())) for _ in range(2)]
                      for side, interval in (("shared_loads", "1"), ("own_loads", "0"))}
        metrics = {side: [f"http://127.0.0.1:{f[f.index('--metrics-port') + 1]}/metrics" for f in flags
                          if "--metrics-port" in f] for side, flags in groups.items()}
        orchestrators = {}
        for side, flags in groups.items():
            orchestrators[side] = [_started(stack, Service("orchestrator", [*f, "--draft", draft.address, *common]))
                                   for f in flags]
            for orchestrator in orchestrators[side]:
                orchestrator.ready(LOG_DIR, 120)
        result = run(orchestrators, targets, prompts, clients, args.new_tokens, args.reps, metrics)
    result.update(**pair_record(args), repeat=args.repeat,
                  new_tokens=args.new_tokens, prompts=args.prompts.split(","), threads=args.threads,
                  compare=args.compare, orchestrators_per_side=len(orchestrators[SIDES[args.compare][0]]),
                  machine=machine())
    write(out, result)
    first, reference = SIDES[args.compare]
    print(f"{'clients':>7} {first + ' tok/s':>18} {reference + ' tok/s':>18}  ratio (cut)  calls (A, B) and the "
          f"busier target's mean share, each side")
    for c in clients:
        a, b = result["modes"][first][str(c)], result["modes"][reference][str(c)]
        print(f"{c:>7} {cut(a['tok_s']):18.2f} {cut(b['tok_s']):18.2f}  {cut(result['over_reference'][str(c)]):10.2f}x"
              f"  {a['target_calls']} {cut(a['busier_share_mean']):.2f}; {b['target_calls']} "
              f"{cut(b['busier_share_mean']):.2f}")
    if args.compare == "load":
        print("samples with 2+ sessions in which one target held more than half (rounded up):")
        for c in clients:
            shares = [result["modes"][side][str(c)]["crowded_share"] for side in (first, reference)]
            print(f"{c:>7} " + "  ".join(f"{side} {'-' if x is None else f'{cut(x):.2f}'}"
                                          for side, x in zip((first, reference), shares)))
    print(f"rounds of requests whose replies equal {reference}'s: {result['identical_rounds']}/{result['rounds']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
