"""What the HTTP API costs over the gRPC API: one deployment (target, draft,
orchestrator with --http-port), the same greedy requests sent through both,
alternating, side by side in one run.

For each request it takes the client's time to the final event (gRPC) or to
the answer's last chunk (HTTP), and the orchestrator's own time for the
generation (the final stats' total_ms); the difference is what lies outside
the generation: the client library, the transport, and for HTTP the gateway's
extra loopback gRPC hop and JSON. Tokens must be the same through both.

    python -m bench.http_probe                     # the default pair, 4 prompts x 64 tokens, 3 reps
    python -m bench.http_probe --new-tokens 128 --reps 5

Writes bench/results/http_probe.json."""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import urllib.request
from pathlib import Path

from bench.common import (PROMPTS, RESULTS, cut, machine, pair_deployment, pair_flags, pair_record, parse_args,
                          request_flags, write)
from tandem.client import TandemClient
from tandem.launch import free_port

log = logging.getLogger("bench.http_probe")
WAYS = ("grpc_stream", "http", "http_stream")


def _grpc(client: TandemClient, prompt: str, new_tokens: int) -> tuple[float, float, list[int]]:
    start, ids = time.perf_counter(), []
    for event in client.generate_stream(prompt, max_tokens=new_tokens, temperature=0.0):
        if event.HasField("delta"):
            ids += event.delta.token_ids
        else:
            return time.perf_counter() - start, event.final.stats.total_ms / 1e3, ids
    raise RuntimeError("no final event")


def _http(base: str, prompt: str, new_tokens: int, stream: bool) -> tuple[float, float, list[int]]:
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": stream, "return_token_ids": True}
    request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start, ids = time.perf_counter(), []
    with urllib.request.urlopen(request, timeout=600) as reply:
        if not stream:
            answer = json.load(reply)
            return time.perf_counter() - start, answer["tandem"]["total_ms"] / 1e3, answer["choices"][0]["token_ids"]
        for line in reply:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            ids += chunk["choices"][0].get("token_ids", [])
            if chunk["choices"][0]["finish_reason"]:
                return time.perf_counter() - start, chunk["tandem"]["total_ms"] / 1e3, ids
    raise RuntimeError("no final chunk")


def run(address: str, base: str, prompts: dict[str, str], new_tokens: int, reps: int) -> dict:
    runs = {way: [] for way in WAYS}
    client = TandemClient(address, timeout_s=600)  # one channel, as a client keeps it
    for way in WAYS:  # warm-up
        (_grpc(client, next(iter(prompts.values())), 8) if way == "grpc_stream"
         else _http(base, next(iter(prompts.values())), 8, stream=way == "http_stream"))
    for rep in range(reps):
        for name, prompt in prompts.items():
            order = WAYS if rep % 2 == 0 else WAYS[::-1]  # alternate who goes first
            for way in order:
                if way == "grpc_stream":
                    wall, inside, ids = _grpc(client, prompt, new_tokens)
                else:
                    wall, inside, ids = _http(base, prompt, new_tokens, stream=way == "http_stream")
                runs[way].append({"prompt": name, "rep": rep, "wall_s": wall, "generation_s": inside, "ids": ids})
                log.info("%s %s: %.3f s (%.1f ms outside the generation)", name, way, wall, (wall - inside) * 1e3)
    client.close()
    reference = runs["grpc_stream"]
    summary = {}
    for way, rows in runs.items():
        tokens = sum(len(r["ids"]) for r in rows)
        summary[way] = {
            "tok_s": tokens / sum(r["wall_s"] for r in rows),
            "outside_ms_p50": statistics.median((r["wall_s"] - r["generation_s"]) * 1e3 for r in rows),
            "outside_ms_max": max((r["wall_s"] - r["generation_s"]) * 1e3 for r in rows),
            "identical": sum(r["ids"] == ref["ids"] for r, ref in zip(rows, reference)),
            "requests": len(rows),
        }
    return {"modes": summary, "runs": {w: [{k: v for k, v in r.items() if k != "ids"} for r in rows]
                                       for w, rows in runs.items()},
            "http_vs_grpc_tok_s": summary["http"]["tok_s"] / summary["grpc_stream"]["tok_s"],
            "http_stream_vs_grpc_tok_s": summary["http_stream"]["tok_s"] / summary["grpc_stream"]["tok_s"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.http_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    pair_flags(parser)
    request_flags(parser, reps=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per service (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS / "http_probe.json", help="JSON output path")
    args = parse_args(parser, argv)
    prompts = {name: PROMPTS[name] for name in args.prompts.split(",")}
    http_port = free_port()
    deployment = pair_deployment(args, ["--http-port", str(http_port), "--prefix-cache", "0"])  # each prefills its prompt
    with deployment:
        result = run(deployment.address, f"http://127.0.0.1:{http_port}", prompts, args.new_tokens, args.reps)
    result.update(**pair_record(args), new_tokens=args.new_tokens,
                  machine=machine())
    write(args.out, result)
    print(f"{'way':<12} {'tok/s':>7} {'outside ms p50':>15} {'max':>7} {'same':>6}")
    for way, row in result["modes"].items():
        print(f"{way:<12} {row['tok_s']:7.2f} {row['outside_ms_p50']:15.2f} {row['outside_ms_max']:7.2f} "
              f"{row['identical']:>3}/{row['requests']}")
    print(f"HTTP over gRPC, tok/s: {cut(result['http_vs_grpc_tok_s']):.2f}x non-streamed, "
          f"{cut(result['http_stream_vs_grpc_tok_s']):.2f}x streamed (cut)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
