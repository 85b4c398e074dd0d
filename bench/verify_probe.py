"""Where a verify's time goes, in one process, each path side by side:
  bare                 the bare forward of a block (as bench.step_probe times it)
  verifier             the target service's `Verifier.verify` of the same block
                       on its session store
  verifier_thread      the same on a worker thread that sleeps between calls,
                       as a service's model thread does
  verifier_spin        the same on a worker thread that polls for the call
                       (from 2 ms before it; blocked during the other paths)
  verifier_after_idle  the same on the main thread after an untimed pause, as a
                       service waits between blocks
  tree                 the block with alternatives beside it (a one-level token tree)
The paths take turns, one call each, so that clocks and caches drift alike for
all. With --profile, a torch profile of a few `verifier` calls: the host's and
the GPU's time per op, and the GPU's busy time per call.

Each call feeds one new token and a block of k draft tokens, as a verify after
a rejected block does, so a session grows by at least one token a call.

    python -m bench.verify_probe --target T --device cuda --profile

Writes bench/results/verify_probe.json."""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.common import RESULTS, machine, parse_args, write
from bench.step_probe import prompt, summary

log = logging.getLogger("bench.verify_probe")


SPIN_LEAD_S = 0.002  # `verifier_spin`: the worker polls this long, untimed, before its call


class Session:
    """One session of the verifier's store, fed a call at a time."""

    def __init__(self, verifier, name: str, first: list[int]):
        self.verifier, self.name = verifier, name
        self.pending = first  # committed tokens the target has not seen yet

    def call(self, block: list[int], alternatives=()):
        from tandem.sampling import SamplingParams
        from target_service.verifier import VerifyCall

        cache = self.verifier.store.peek(self.name)
        length = 0 if cache is None else len(cache)
        fp = 0 if cache is None else cache.fps[-1]
        outcome = self.verifier.verify(VerifyCall(
            session_id=self.name, prefix_len=length, prefix_fp=fp, new_tokens=self.pending,
            draft_tokens=block, draft_probs=[], draft_dists=None, sampling=SamplingParams(),
            alternatives=tuple(alternatives)))
        self.pending = [outcome.next_token, *outcome.more_tokens]
        return outcome


class Spinner:
    """A worker thread that does not sleep between calls while armed: from
    `arm()` to the end of its next call it polls for that call, yielding the
    GIL (and the core) at each poll, a time.sleep(0) (on Linux a sleep of the
    thread's timer slack, 50 µs by default). Unarmed, it blocks,
    so that it takes no core and no GIL from the other paths' calls (on a
    one-core CPU a thread polling through them took a third of the core)."""

    def __init__(self):
        self._job = None
        self._armed = threading.Event()
        self._done = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        while True:
            self._armed.wait()
            if self._stopped:
                return
            job = self._job
            if job is None:
                time.sleep(0)
                continue
            self._job = None
            self._armed.clear()
            fn, args, box = job
            try:
                box.append(fn(*args))
            except BaseException as err:  # handed to the caller, which raises it
                box.append(err)
            self._done.set()

    def arm(self):
        """Starts polling for the next call."""
        self._armed.set()

    def run(self, fn, *args):
        box = []
        self._done.clear()
        self._job = (fn, args, box)
        self._armed.set()
        self._done.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def stop(self):
        self._stopped = True
        self._armed.set()
        self._thread.join()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.verify_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="default-target", help="target model (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="auto = what a model service picks (default: %(default)s)")
    parser.add_argument("--k", type=int, default=3, help="draft tokens a block (default: %(default)s)")
    parser.add_argument("--tree", type=int, default=4, help="alternatives beside the block in `tree`; 0 skips it "
                        "(default: %(default)s)")
    parser.add_argument("--reps", type=int, default=40, help="timed calls per path (default: %(default)s)")
    parser.add_argument("--warmups", type=int, default=5, help="untimed calls per path first (default: %(default)s)")
    parser.add_argument("--idle-ms", type=float, default=20.0, help="`verifier_after_idle`: the process sleeps this "
                        "long, untimed, before each call, as a service waits for the next block (default: %(default)s)")
    parser.add_argument("--profile", action="store_true", help="profile some verifier calls (torch.profiler)")
    parser.add_argument("--out", type=Path, default=RESULTS / "verify_probe.json", help="JSON output path")
    args = parse_args(parser, argv)
    if args.reps < 2 or args.k < 1:
        parser.error("--reps must be at least 2 and --k at least 1")

    from tandem.modeling import ModelConfig, ModelRunner, load, use_gpu_host_settings
    from tandem.session_cache import SessionCacheStore
    from target_service.verifier import Verifier

    cuda = torch.device(args.device).type == "cuda"
    if cuda:
        use_gpu_host_settings()  # as the services do
    loaded = load(ModelConfig(args.target, device=args.device, dtype=args.dtype))
    runner = ModelRunner(loaded, args.device)
    verifier = Verifier(runner, SessionCacheStore(runner.new_cache))
    ids = prompt(loaded.vocab_size)
    block = ids[1:1 + args.k]
    alternatives = [(j, ids[-1 - j]) for j in range(min(args.tree, args.k))]

    kv = runner.new_cache()
    bare_next = [int(runner.forward(kv, ids, logits_to_keep=1)[0].argmax())]

    def bare():
        nonlocal bare_next
        logits = runner.forward(kv, bare_next + block, logits_to_keep=args.k + 1)
        bare_next = logits.argmax(dim=-1).tolist()[:1]
        kv.crop(-args.k)

    names = ("verifier", "verifier_thread", "verifier_spin", "verifier_after_idle", "tree")
    sessions = {name: Session(verifier, name, ids) for name in names}
    worker = ThreadPoolExecutor(max_workers=1)
    spinner = Spinner()
    paths = {
        "bare": bare,
        "verifier": lambda: sessions["verifier"].call(block),
        "verifier_thread": lambda: worker.submit(sessions["verifier_thread"].call, block).result(),
        "verifier_spin": lambda: spinner.run(sessions["verifier_spin"].call, block),
        "verifier_after_idle": lambda: sessions["verifier_after_idle"].call(block),
    }
    before = {"verifier_after_idle": lambda: time.sleep(args.idle_ms / 1e3),  # untimed
              "verifier_spin": lambda: (spinner.arm(), time.sleep(SPIN_LEAD_S))}  # polling when the call comes
    if alternatives and runner.verifies_trees:
        paths["tree"] = lambda: sessions["tree"].call(block, alternatives)
    times = {name: [] for name in paths}
    for i in range(args.warmups + args.reps):
        for name, path in paths.items():
            if name in before:
                before[name]()
            start = time.perf_counter()
            path()
            if i >= args.warmups:
                times[name].append((time.perf_counter() - start) * 1e3)
    spinner.stop()
    result = {"machine": machine(), "device": args.device, "target": args.target, "k": args.k,
              "alternatives": len(alternatives), "dtype": str(loaded.model.dtype).removeprefix("torch."),
              "paths": {name: summary(t) for name, t in times.items()}}
    print(f"{'path':<18}{'median ms':>10}{'p10':>8}{'p90':>8}")
    for name, entry in result["paths"].items():
        print(f"{name:<18}{entry['median_ms']:>10.2f}{entry['p10_ms']:>8.2f}{entry['p90_ms']:>8.2f}")

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        calls = 10
        walls = []
        with profile(activities=activities) as prof:
            for _ in range(calls):
                start = time.perf_counter()
                paths["verifier"]()
                walls.append((time.perf_counter() - start) * 1e3)
        averages = prof.key_averages()
        by_host = averages.table(sort_by="self_cpu_time_total", row_limit=30)
        print(by_host)
        try:  # the kernels' own time, not the ops' that launched them
            from torch.autograd import DeviceType
            device_us = sum(e.self_device_time_total for e in averages if e.device_type == DeviceType.CUDA)
        except (ImportError, AttributeError) as err:
            log.info("no device time from the profile: %s", err)
            device_us = float("nan")
        counts = {e.key: e.count for e in averages
                  if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
                               "aten::item", "aten::_local_scalar_dense", "cudaLaunchKernel",
                               "cudaEventSynchronize", "aten::nonzero")}
        result["profile"] = {
            "calls": calls,
            "wall_ms_per_call_under_profiler": statistics.median(walls),
            "device_busy_ms_per_call": device_us / 1e3 / calls,
            "op_counts_per_call": {key: count / calls for key, count in counts.items()},
            "top_by_host_time": [
                {"op": e.key, "self_cpu_ms_per_call": e.self_cpu_time_total / 1e3 / calls, "count_per_call": e.count / calls}
                for e in sorted(averages, key=lambda e: -e.self_cpu_time_total)[:30]],
        }
        if cuda:
            print(averages.table(sort_by="self_device_time_total", row_limit=15))
        print(f"profiled: wall {result['profile']['wall_ms_per_call_under_profiler']:.2f} ms a call, "
              f"device busy {result['profile']['device_busy_ms_per_call']:.2f} ms, counts {result['profile']['op_counts_per_call']}")
    worker.shutdown()
    write(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
