"""What the int4 draft's linear layers cost on this CPU, alone: every linear
layer of a draft model of the given shape and its reduced-vocabulary head,
through tandem/i4w.c (`tandem.i4w.linear`), for 1, 2 and 4 rows, on distinct
random weights so that nothing stays in cache, one pinned thread, best and
median of `--repeats`; beside it a torch sum over as many bytes, the rate this
core reads memory at. A draft step streams all of these weights for one token,
so the one-row figure against the sum's says whether the kernel is bound by its
arithmetic or by the weights' stream.

    python -m bench.i4w_probe                      # the default draft's shape, 32k head
    python -m bench.i4w_probe --draft PATH --head 16384 --repeats 12

The shape comes from the model's config (no weights are read). Writes
bench/results/i4w_probe.json."""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import RESULTS, machine, parse_args, write

log = logging.getLogger("bench.i4w_probe")


def layer_shapes(config: dict, head: int) -> list[tuple[int, int]]:
    """(out_features, in_features) of each linear layer the draft runs for a
    token, in order, then its head: a Llama-family decoder (q, k, v, o, gate,
    up, down a layer)."""
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    q = heads * head_dim
    per_layer = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (inter, hidden), (inter, hidden),
                 (hidden, inter)]
    return per_layer * layers + ([(head, hidden)] if head else [])


def time_layers(shapes: list[tuple[int, int]], rows: list[int], repeats: int) -> dict:
    from draft_service.cheap import quantize_groups
    from tandem import i4w

    packed_by_shape = {}
    for shape in sorted(set(shapes)):
        codes, scale, low = quantize_groups(torch.randn(shape) * 0.02, i4w.GROUP)
        packed_by_shape[shape] = i4w.pack(codes, scale, low)
    weights = [(packed_by_shape[shape].clone(), shape) for shape in shapes]  # distinct copies: none stays cached
    nbytes = sum(w.numel() for w, _ in weights)
    widths = {k for _, k in shapes}
    result = {"weight_bytes": nbytes, "layers": len(shapes), "rows": {}}
    for m in rows:
        xs = {k: torch.randn(m, k) for k in widths}
        for w, (n, k) in weights[:4]:  # build and warm
            i4w.linear(xs[k], w, None, n)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for w, (n, k) in weights:
                i4w.linear(xs[k], w, None, n)
            times.append(time.perf_counter() - start)
        best, med = min(times), statistics.median(times)
        result["rows"][str(m)] = {"best_ms": best * 1e3, "median_ms": med * 1e3, "best_gb_s": nbytes / best / 1e9}
        log.info("%d row(s): best %.2f ms, median %.2f ms, %.1f GB/s", m, best * 1e3, med * 1e3, nbytes / best / 1e9)
    flat = torch.rand(nbytes // 4)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        flat.sum()
        times.append(time.perf_counter() - start)
    result["torch_sum"] = {"best_ms": min(times) * 1e3, "best_gb_s": nbytes / min(times) / 1e9}
    log.info("torch sum over %.0f MB: best %.2f ms, %.1f GB/s", nbytes / 1e6, min(times) * 1e3, nbytes / min(times) / 1e9)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default="default-draft", help="draft model whose config.json gives the shapes "
                                                                 "(default: %(default)s)")
    parser.add_argument("--head", type=int, default=32768, help="rows of the reduced-vocabulary head, 0 = none "
                                                                "(default: %(default)s)")
    parser.add_argument("--rows", default="1,2,4", help="rows of x per forward, comma-separated (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=8, help="passes over all the layers per row count "
                                                               "(default: %(default)s)")
    parser.add_argument("--core", type=int, default=None,
                        help="pin to this core (default: the last one this process may use)")
    parser.add_argument("--out", default=str(RESULTS / "i4w_probe.json"), help="JSON output path")
    args = parse_args(parser, argv)
    from tandem import i4w
    from tandem.default_models import resolve_model

    if i4w.unavailable() is not None:
        print(f"the i4w kernel cannot run here: {i4w.unavailable()}", file=sys.stderr)
        return 2
    try:
        rows = [int(r) for r in args.rows.split(",") if r]
    except ValueError:
        parser.error(f"--rows: comma-separated integers, got {args.rows!r}")
    if not rows or min(rows) < 1 or args.repeats < 1 or args.head < 0:
        parser.error("--rows and --repeats must be at least 1, --head at least 0")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(resolve_model(args.draft)).to_dict()
    except (OSError, ValueError) as err:
        print(f"--draft {args.draft}: no model config to read ({err})", file=sys.stderr)
        return 2
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[-1] if args.core is None else args.core
    if core not in allowed:
        print(f"--core {core}: this process may use cores {allowed} only", file=sys.stderr)
        return 2
    shapes = layer_shapes(config, args.head)
    threads = torch.get_num_threads()
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    try:
        result = time_layers(shapes, rows, args.repeats)
    finally:  # the caller's cores and threads back (a test calls main in its own process)
        os.sched_setaffinity(0, allowed)
        torch.set_num_threads(threads)
    write(Path(args.out), {"machine": machine(), "core": core, "draft": str(args.draft), "head": args.head,
                           "i4w_flags": i4w._flags(), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
