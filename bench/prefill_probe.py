"""What chunked prefill (--prefill-chunk) does for the requests a long prompt
arrives beside (README: "`--prefill-chunk`"): two deployments of the pair,
one with the model services' --prefill-chunk N (auto: 256 on a CPU) and one
with 0 (a prefill runs whole, in one call). In each pass, on one side and
then the other (the order alternating), a decoding client streams a greedy
request with a short prompt; once it has streamed its first tokens, a
second client sends a long prompt (`--prompt-tokens`, text cut from this
repository's README) and asks for a few tokens.

For each side it records the decoding stream's longest wait between two of
its chunks while the long prompt was prefilled, its tokens per second, the
long request's time to its first token, and whether both requests' tokens
are the same on both sides (chunking moves calls, it changes no token).

    python -m bench.prefill_probe                         # 1024-token prompt, 3 passes
    python -m bench.prefill_probe --prompt-tokens 2048 --chunk 128
    python -m bench.prefill_probe --forward-only          # the target's prefill alone: whole and in chunks

--forward-only times no deployment: the target's forward in this process (as
its service builds it), on an empty cache, one thread, over 512, 1024 and 2048
tokens of random ids, whole and in chunks of 512, 256 and 128: what a chunk
costs the prompt itself.

Writes bench/results/prefill_probe.json."""
from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import threading
import time
from pathlib import Path

from bench.common import PROMPTS, RESULTS, cut, machine, pair_deployment, pair_flags, pair_record, parse_args, write
from tandem.client import TandemClient
from tandem.redis_local import ensure_redis

log = logging.getLogger("bench.prefill_probe")
README = Path(__file__).resolve().parent.parent / "README.md"


def long_prompt(tokenizer_dir: str, tokens: int) -> list[int]:
    """The README's first `tokens` tokens under the target's tokenizer."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tokenizer_dir).encode(README.read_text())
    if len(ids) < tokens:
        raise SystemExit(f"--prompt-tokens {tokens}: the README has {len(ids)} tokens")
    return ids[:tokens]


def _decode(address: str, prompt: str, new_tokens: int, began: threading.Event, out: dict) -> None:
    """Streams a greedy request; out: each chunk's arrival (perf_counter) and the tokens."""
    arrivals, ids = [], []
    with TandemClient(address, timeout_s=1800) as client:
        for event in client.generate_stream(prompt, max_tokens=new_tokens, temperature=0.0, ignore_eos=True):
            if event.HasField("delta") and event.delta.token_ids:
                arrivals.append(time.perf_counter())
                ids.extend(event.delta.token_ids)
                if len(ids) >= 4:
                    began.set()
    began.set()
    out.update(arrivals=arrivals, token_ids=ids)


def one_pass(address: str, prompt: str, new_tokens: int, long_ids: list[int], long_tokens: int) -> dict:
    began, decoded = threading.Event(), {}
    decoder = threading.Thread(target=_decode, args=(address, prompt, new_tokens, began, decoded), daemon=True)
    start = time.perf_counter()
    decoder.start()
    began.wait()
    sent = time.perf_counter()
    first, long_out = None, []
    with TandemClient(address, timeout_s=1800) as client:
        for event in client.generate_stream(prompt_ids=long_ids, max_tokens=long_tokens, temperature=0.0,
                                            ignore_eos=True):
            if event.HasField("delta") and event.delta.token_ids:
                first = first if first is not None else time.perf_counter() - sent
                long_out.extend(event.delta.token_ids)
    long_done = time.perf_counter()
    decoder.join()
    arrivals = decoded["arrivals"]
    # The decoding stream's gaps between chunks that arrived while the long request ran.
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > sent and a < long_done]
    wall = arrivals[-1] - start
    return {"long_ttft_s": first, "decode_max_gap_s": max(during, default=0.0),
            "decode_gaps_during_long": len(during), "decode_tok_s": len(decoded["token_ids"]) / wall,
            "decode_wall_s": wall, "decode_token_ids": decoded["token_ids"], "long_token_ids": long_out}


def run(addresses: dict[str, str], prompt: str, new_tokens: int, long_ids: list[int], long_tokens: int,
        reps: int) -> dict:
    sides = list(addresses)
    for address in addresses.values():  # warm-up: a short request and a prefill of the long prompt's length
        one_pass(address, prompt, 8, long_ids, 1)
    rows = {side: [] for side in sides}
    for rep in range(reps):
        turn = rep % len(sides)
        for side in sides[turn:] + sides[:turn]:
            row = one_pass(addresses[side], prompt, new_tokens, long_ids, long_tokens)
            rows[side].append({"rep": rep, **row})
            log.info("%s: long prompt's first token %.2f s; decoding stream: longest gap %.2f s over %d gaps, "
                     "%.2f tok/s", side, row["long_ttft_s"], row["decode_max_gap_s"], row["decode_gaps_during_long"],
                     row["decode_tok_s"])
    summary = {side: {key: statistics.median(r[key] for r in rows[side])
                      for key in ("long_ttft_s", "decode_max_gap_s", "decode_tok_s")} for side in sides}
    chunked, whole = sides
    return {
        "modes": summary,
        "whole_over_chunked": {key: summary[whole][key] / summary[chunked][key]
                               for key in ("long_ttft_s", "decode_max_gap_s")},
        "identical_passes": sum(a["decode_token_ids"] == b["decode_token_ids"]
                                and a["long_token_ids"] == b["long_token_ids"]
                                for a, b in zip(rows[chunked], rows[whole])),
        "passes": reps,
        "runs": {side: [{k: v for k, v in r.items() if not k.endswith("token_ids")} for r in rows[side]]
                 for side in sides},
    }


def forward_only(target: str, lengths=(512, 1024, 2048), chunks=(512, 256, 128)) -> dict:
    """Seconds of the target's prefill of n random tokens, whole and in chunks."""
    import torch

    from target_service.server import target_runner
    from tandem.modeling import ModelConfig, load

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = ModelConfig(target, threads=1)
        runner = target_runner(load(config), config.device, "auto")
        return {"forward_only": _time_forwards(runner, lengths, chunks), "kernel": config.kernel, "threads": 1}
    finally:
        torch.set_num_threads(threads)


def _time_forwards(runner, lengths, chunks) -> list[dict]:
    import torch

    ids = torch.randint(0, runner.loaded.vocab_size, (max(lengths),), generator=torch.Generator().manual_seed(0))
    ids = ids.tolist()

    def seconds(total: int, chunk: int) -> float:
        kv, start = runner.new_cache(), time.perf_counter()
        for at in range(0, total, chunk):
            runner.forward(kv, ids[at:min(at + chunk, total)], logits_to_keep=1)
        return time.perf_counter() - start

    seconds(64, 64)  # warm-up
    rows = []
    for total in lengths:
        for chunk in (total, *(c for c in chunks if c < total)):
            s = seconds(total, chunk)
            rows.append({"tokens": total, "chunk": chunk, "seconds": s, "tok_s": total / s})
            log.info("%d tokens in chunks of %d: %.2f s, %.1f tok/s", total, chunk, s, total / s)
    return rows


def main(argv=None) -> int:
    from tandem import default_models

    parser = argparse.ArgumentParser(prog="python -m bench.prefill_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    pair_flags(parser)
    parser.add_argument("--chunk", default="auto", help="the chunked side's --prefill-chunk (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=1024,
                        help="tokens of the long prompt (default: %(default)s)")
    parser.add_argument("--long-tokens", type=int, default=8,
                        help="tokens the long prompt's request generates (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=96,
                        help="tokens of the decoding stream (default: %(default)s)")
    parser.add_argument("--prompt", default="code-1", choices=sorted(PROMPTS),
                        help="the decoding stream's prompt (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=3, help="passes, each side once a pass (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per service (default: %(default)s)")
    parser.add_argument("--forward-only", action="store_true",
                        help="time the target's prefill alone, whole and in chunks, in this process")
    parser.add_argument("--out", type=Path, default=RESULTS / "prefill_probe.json", help="JSON output path")
    args = parse_args(parser, argv)
    if args.forward_only:
        result = {**forward_only(default_models.resolve_model(args.target)), "target": args.target,
                  "machine": machine()}
        write(args.out, result)
        print(f"{'tokens':>7} {'chunk':>6} {'s':>8} {'tok/s':>8}")
        for row in result["forward_only"]:
            print(f"{row['tokens']:>7} {row['chunk']:>6} {cut(row['seconds']):8.2f} {cut(row['tok_s']):8.2f}")
        return 0
    if args.reps < 1 or args.prompt_tokens < 1:
        parser.error("--reps and --prompt-tokens must be >= 1")
    long_ids = long_prompt(default_models.resolve_model(args.target), args.prompt_tokens)
    redis = ensure_redis()
    sides = {f"chunk {args.chunk}": args.chunk, "chunk 0 (whole)": "0"}
    addresses = {}
    with contextlib.ExitStack() as stack:
        for side, chunk in sides.items():  # one after the other: two targets loading at once may not fit
            deployment = pair_deployment(args, ["--redis-url", redis, "--prefix-cache", "0"],
                                         ["--prefill-chunk", chunk])
            addresses[side] = stack.enter_context(deployment).address
        result = run(addresses, PROMPTS[args.prompt], args.new_tokens, long_ids, args.long_tokens, args.reps)
    result.update(**pair_record(args), chunk=args.chunk,
                  prompt_tokens=args.prompt_tokens, long_tokens=args.long_tokens, new_tokens=args.new_tokens,
                  prompt=args.prompt, threads=args.threads, machine=machine())
    write(args.out, result)
    print(f"{'side (medians, cut)':>18} {'long prompt: first token s':>27} {'decoding: longest gap s':>24} "
          f"{'decoding tok/s':>15}")
    for side, mode in result["modes"].items():
        print(f"{side:>18} {cut(mode['long_ttft_s']):27.2f} {cut(mode['decode_max_gap_s']):24.2f} "
              f"{cut(mode['decode_tok_s']):15.2f}")
    ratio = result["whole_over_chunked"]
    print(f"whole over chunked (cut): longest gap {cut(ratio['decode_max_gap_s']):.2f}x, "
          f"long prompt's first token {cut(ratio['long_ttft_s']):.2f}x (medians)")
    print(f"passes whose tokens are the same on both sides: {result['identical_passes']}/{result['passes']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
