"""The floor under a model call's overhead: a bare grpc.aio stream round trip
between two processes pinned to two cores, with no Tandem code on its path.

An echo service (a generic bidirectional-stream handler on raw bytes) answers
each message, after streaming `--touch-mb` MB of memory through the caches when
asked: as a model's forward does before the service replies, which leaves the
gRPC path's code and data cold. The time of that touch is sent back and
subtracted, so each figure is what the round trip costs beyond the "compute".

    python -m bench.grpc_floor                 # 0 and 256 MB, 1000 round trips each
    python -m bench.grpc_floor --touch-mb 0,64,1024 --messages 500

Writes bench/results/grpc_floor.json. Compare with the request stats of
bench.nodes: overhead_ms_per_round_p50 (one or two model calls a round) and
overhead_in_services_ms_p50 (the part in the services' handlers)."""
from __future__ import annotations

import argparse
import asyncio
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

from bench.common import RESULTS, machine, write
from tandem.launch import free_port

SERVICE, METHOD = "tandem.bench.Echo", "Chat"
WARM_UP = 100  # round trips not counted
TIME_FIELD = 12  # bytes at the end of a reply: the touch's time, microseconds
START_TIMEOUT_S = 120  # the echo side imports torch and fills its memory


async def serve(port: int, touch_mb: int) -> None:
    import torch

    torch.set_num_threads(1)
    block = torch.ones(max(touch_mb, 1) * 2**20 // 4) if touch_mb else None

    async def chat(messages, context):
        async for message in messages:
            touched_us = 0  # no touch, nothing to time (two clock reads alone can round to 1 us)
            if block is not None:
                start = time.perf_counter()
                block.sum()
                touched_us = round((time.perf_counter() - start) * 1e6)
            yield message + str(touched_us).encode().rjust(TIME_FIELD)

    handler = grpc.method_handlers_generic_handler(SERVICE, {METHOD: grpc.stream_stream_rpc_method_handler(chat)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


async def round_trips(port: int, messages: int, size: int) -> tuple[list[float], list[float]]:
    """Milliseconds per round trip beyond the echo side's touch, and of the
    touch, after the warm-up."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(f"/{SERVICE}/{METHOD}")()
        payload = b"x" * size
        times, touches = [], []
        for _ in range(WARM_UP + messages):
            start = time.perf_counter()
            await call.write(payload)
            reply = await call.read()
            touches.append(int(reply[-TIME_FIELD:]) / 1e3)
            times.append((time.perf_counter() - start) * 1e3 - touches[-1])
        await call.done_writing()
        return times[WARM_UP:], touches[WARM_UP:]


def measure(touch_mb: int, messages: int, size: int, cores: tuple[int, int]) -> dict:
    port = free_port()
    echo = subprocess.Popen([sys.executable, "-m", "bench.grpc_floor", "--serve", str(port), "--touch-mb", str(touch_mb),
                             "--cores", f"{cores[0]},{cores[1]}"], stdout=subprocess.PIPE, text=True)
    try:
        if not select.select([echo.stdout], [], [], START_TIMEOUT_S)[0]:
            raise RuntimeError(f"the echo service did not start within {START_TIMEOUT_S} s")
        if echo.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the echo service did not start (exit code {echo.wait()})")
        times, touches = asyncio.run(round_trips(port, messages, size))
        times.sort()
    finally:
        echo.kill()
        echo.wait()
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))]  # noqa: E731
    return {"touch_mb": touch_mb, "round_trips": len(times), "p10_ms": pick(0.1),
            "p50_ms": statistics.median(times), "p90_ms": pick(0.9), "touch_ms_p50": statistics.median(touches)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--touch-mb", default="0,256",
                        help="comma-separated MB the echo side streams before each reply (default: %(default)s)")
    parser.add_argument("--messages", type=int, default=1000, help="round trips timed per setting (default: %(default)s)")
    parser.add_argument("--size", type=int, default=200, help="bytes per message (default: %(default)s)")
    parser.add_argument("--cores", default="0,1",
                        help="the echo side's core, then the caller's (default: %(default)s)")
    parser.add_argument("--out", default=str(RESULTS / "grpc_floor.json"), help="JSON output path")
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the echo side
    args = parser.parse_args(argv)
    try:
        echo_core, caller_core = (int(c) for c in args.cores.split(","))
        sizes_mb = [int(mb) for mb in args.touch_mb.split(",")]
    except ValueError:
        parser.error(f"--cores takes two core numbers and --touch-mb whole MB, got {args.cores!r} and {args.touch_mb!r}")
    if min(sizes_mb) < 0 or args.messages < 1 or args.size < 1:
        parser.error("--touch-mb must be >= 0, --messages and --size >= 1")
    if args.serve is not None:  # started by measure(), on the caller's core: it moves to its own
        os.sched_setaffinity(0, {echo_core})
        asyncio.run(serve(args.serve, sizes_mb[0]))
        return 0
    available = os.sched_getaffinity(0)
    if not {echo_core, caller_core} <= available:
        parser.error(f"--cores {args.cores}: this process may run on cores {sorted(available)} only")
    rows = []
    os.sched_setaffinity(0, {caller_core})
    try:
        for mb in sizes_mb:
            print(f"{args.messages} round trips, the echo side streaming {mb} MB before each reply …", flush=True)
            rows.append(measure(mb, args.messages, args.size, (echo_core, caller_core)))
            r = rows[-1]
            print(f"  beyond the touch ({r['touch_ms_p50']:.1f} ms p50): p10 {r['p10_ms']:.3f} ms, p50 {r['p50_ms']:.3f} ms, "
                  f"p90 {r['p90_ms']:.3f} ms")
    finally:
        os.sched_setaffinity(0, available)  # a caller (a test) keeps its cores
    payload = {"machine": machine(), "message_bytes": args.size, "cores": [echo_core, caller_core], "results": rows}
    write(Path(args.out), payload)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
