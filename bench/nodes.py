"""Two-node benchmark (make bench-nodes): two nodes emulated on this machine by
pinning the target service to core 0 and the draft service to core 1 (one torch
thread each), the orchestrator alongside. Modes, side by side in one run:
  (a) target alone, one pinned core          (e) target alone, both cores
  (b) Tandem sequential on the two nodes     (f) HF assisted in-process, both cores
  (c) Tandem pipelined, fixed k = 2..5       (g) Tandem on the whole machine, unpinned
  (d) Tandem pipelined, adaptive k
With --device cuda both services share the one GPU, each in its own process,
and the target alone (a) and HF assisted (f) run on it too. There (a) also runs
each one-token forward replayed from a CUDA graph of the lean forward
(a_target_one_core_graphs, as the target service's --graphs verifies), the
fair baseline for a graphed verify, and the speedups are over the faster of
the two. (e) and (g), which differ from (a) and (d) only in CPU placement,
are not run there, and the whole-machine ratio is taken with (d).
The pinned modes run prompt by prompt: each prompt goes through (a) in
Tandem's own kernels, (b), each (c) and (d) before the next prompt starts, so
that a machine whose speed drifts over minutes shifts them alike. The target
alone in its other configurations (kernels, dtypes) runs first, one after
another, and Tandem's own right after them as well (a_target_one_core_own_first):
its two timings show how far the machine drifted between the phases. Then (e),
(f) and (g) run the same way, one configuration of (g) at a time with (f)
beside each.
Writes bench/results/nodes.json and nodes.png."""
from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import sys
from pathlib import Path

import torch

from bench.common import (PROMPTS, RESULTS, ModeResult, TandemTally, count_identical, parse_args, prompt_ids,
                          tandem_generate, write)
from bench.hf_baselines import (baselines, finish, hf_assisted_config, hf_generate, hf_time, hf_warm_up, lean_generate,
                                load_hf, resolve_dtype)
from bench.nodes_report import plot, report

log = logging.getLogger("bench.nodes")


def pin(cpus: set[int], threads: int) -> None:
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)


@contextlib.contextmanager
def on_one_core(cores: list[int], gpu: bool):
    """This process on the first core with one torch thread (the target's
    node), then back on all `cores`; on a GPU, where nothing is pinned, as is."""
    if not gpu:
        pin({cores[0]}, 1)
    try:
        yield
    finally:
        if not gpu:
            pin(set(cores), len(cores))


def whole_configs(spec: str) -> list[tuple[bool, int, int]]:
    """'sequential:2,sequential:2/1,pipelined:1' -> [(False, 2, 2), (False, 2, 1), (True, 1, 1)]:
    (pipeline, target threads, draft threads); MODE:N gives both services N threads."""
    configs = []
    for item in spec.split(","):
        mode, _, threads = item.strip().partition(":")
        target, slash, draft = threads.partition("/")
        draft = draft if slash else target
        if mode not in ("sequential", "pipelined") or not (target.isdigit() and draft.isdigit()) \
                or min(int(target), int(draft)) < 1:
            raise argparse.ArgumentTypeError(f"--whole-configs: expected MODE:THREADS or MODE:TARGET/DRAFT with MODE "
                                             f"sequential or pipelined and thread counts >= 1, got {item!r}")
        configs.append((mode == "pipelined", int(target), int(draft)))
    return configs


# A two-thread target beside a one-thread draft (MODE:2/1) was timed as well
# on a 2-core AMX VM, where the int4 draft steps slower on two threads (44 ms
# against 42 ms); in one full run it was not faster than these (bench/RESULTS.md).
WHOLE_CONFIGS = "sequential:2,pipelined:1"
HF_ASSISTED_K = 3  # mode (f)
MODE_ORDER = "aefbcdg"  # the table's and the JSON's order of modes


def target_linear(target_args: str) -> str:
    """The --linear in the target service's extra flags ('auto' without one)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--linear", default="auto")
    return parser.parse_known_args(target_args.split())[0].linear


def deployment(args, cpus_target, cpus_draft, pinned: bool, whole: tuple[bool, int, int] | None = None):
    """The three processes, started: pinned, each service on its own core (on
    a GPU: its own process on the one GPU) for modes (b)-(d); else unpinned
    for (g), in the configuration `whole` (pipeline, target threads, draft
    threads). Warmed up on every prompt by the caller."""
    from tandem.launch import Deployment, Service
    from tandem.redis_local import ensure_redis

    gpu = args.device != "cpu"
    threads = (None, None) if gpu else (args.threads_per_node,) * 2 if pinned else whole[1:]
    model_args = ["--dtype", args.dtype, "--device", args.device]
    target = Service("target", ["--model", args.target, *model_args, *args.target_args.split()], threads=threads[0],
                     cpus=cpus_target if pinned and not gpu else None)
    draft = Service("draft", ["--model", args.draft, *model_args, *args.draft_args.split()],
                    threads=threads[1], cpus=cpus_draft if pinned and not gpu else None)
    # --prefix-cache 0: each request prefills its prompt, as the target alone does (a
    # warm-up's parked session would otherwise hand its prompt's caches on).
    orchestrator = ["--redis-url", ensure_redis(), "--adaptive-k", "on", "--k", "3", "--pipeline", "auto",
                    "--prefix-cache", "0",
                    "--k-min", str(args.k_min), "--k-max", str(args.k_max), *args.orchestrator_args.split()]
    return Deployment(target, draft, orchestrator)


def table_order(item: tuple[str, ModeResult]) -> tuple[int, bool]:
    """Modes by letter (MODE_ORDER), Tandem's own kernels first among the
    configurations of the target alone; otherwise as they ran."""
    name = item[0]
    return MODE_ORDER.index(name[0]), name not in ("a_target_one_core", "e_target_both_cores")


def rotated(items: list, by: int) -> list:
    """`items` starting at index `by` (mod its length), wrapping around."""
    by %= len(items)
    return items[by:] + items[:by]


def pinned_modes(args, prompts, target, cores: list[int], fixed_ks: list[int]) -> dict[str, ModeResult]:
    """Modes (a) in Tandem's own configuration (`target`, the identity
    reference) and (b)-(d), interleaved: each prompt runs through every mode
    before the next prompt, each prompt starting one mode further along the
    cycle, so that a machine whose speed drifts over minutes (the VMs in
    bench/RESULTS.md drift by 10-40%) shifts every mode alike rather than
    the modes timed last. Sets args.draft_backend to the draft service's own
    label (backend, quantization and its kernel, head)."""
    from tandem.client import TandemClient

    gpu = args.device != "cpu"
    cycle = [("a_target_one_core", None), ("b_sequential", dict(pipeline=False, num_draft_tokens=args.sequential_k)),
             *((f"c_pipelined_k{k}", dict(pipeline=True, num_draft_tokens=k)) for k in fixed_ks),
             ("d_pipelined_adaptive", dict(pipeline=True)),
             ("d_pipeline_auto", dict())]  # no pipeline field: the orchestrator's --pipeline auto picks
    alone = ModeResult()
    tallies = {name: TandemTally() for name, params in cycle if params is not None}
    with on_one_core(cores, gpu):  # left before the deployment: the orchestrator inherits this process's CPUs
        hf_warm_up(target, prompts)
    with deployment(args, str(cores[0]), str(cores[1]), pinned=True) as running, \
            TandemClient(running.address, timeout_s=3600) as client:
        args.draft_backend = client.server_info().draft_backend  # the draft service's label: kernel and head
        # Warm-up: every prompt once, so that no mode pays for first-call costs
        # (kernels set up per shape: each prompt's prefill, the verify lengths).
        # The services' step costs, which the orchestrator learns from every
        # request, start from these rounds.
        tandem_generate(running.address, prompts, 16)
        for i, (name, ids) in enumerate(prompts.items()):
            for mode, params in rotated(cycle, i):
                print(f"{name}: {MODE_TITLES.get(mode, MODE_TITLES[mode[0]])}"
                      f"{'' if params is None else _k_label(params)} …", flush=True)
                if params is None:  # the bench process, on the target's core while the services idle
                    with on_one_core(cores, gpu):
                        hf_time(alone, target, name, ids, args.new_tokens)
                else:
                    tallies[mode].time(client, name, ids, args.new_tokens, **params)
    return {"a_target_one_core": finish(alone), **{name: tally.result() for name, tally in tallies.items()}}


def _k_label(params: dict) -> str:
    return f", k={params['num_draft_tokens']}" if "num_draft_tokens" in params else ", adaptive k"


MODE_TITLES = {"a": "(a) target alone, one node", "b": "(b) Tandem sequential, two nodes",
               "c": "(c) Tandem pipelined", "d": "(d) Tandem pipelined",
               "d_pipeline_auto": "(d) Tandem, --pipeline auto (per request, the mode its measured costs favour)"}


def whole_name(whole: tuple[bool, int, int]) -> str:
    """The mode name of (g) in the configuration `whole` (pipeline, target threads, draft threads)."""
    how = "pipelined" if whole[0] else "sequential"
    target_threads, draft_threads = whole[1:]
    return f"g_whole_machine_{how}_{target_threads}t" + (f"_{draft_threads}t" if draft_threads != target_threads else "")


def whole_title(whole: tuple[bool, int, int]) -> str:
    how = "pipelined" if whole[0] else "sequential"
    return f"(g) Tandem on the whole machine, unpinned, {how}, {whole[1]} target / {whole[2]} draft threads, adaptive k"


def unpinned_modes(args, prompts, target, config: tuple[str, str], draft_path: str, cores: list[int],
                   skip: set[str]) -> dict[str, ModeResult]:
    """Modes (e) (the target alone in Tandem's configuration `config`, loaded as
    `target`), (f) (HF assisted: `target` with the draft in `config`) and (g)
    in each of args.whole_configs, interleaved prompt by prompt as
    pinned_modes does: on these VMs the bandwidth the two cores share changes
    within seconds (bench/RESULTS.md), and (g)/(f) is a goal.

    One (g) deployment is up at a time (two beside the bench's own models
    would need more than 24 GiB while a target loads), so the prompts go round
    once per configuration of (g): (f) runs beside every configuration and its
    tokens/s is over all of its passes; (e) runs in the first pass only. The
    draft of (f) is loaded anew in each pass, after the services."""
    from tandem.client import TandemClient

    gpu = args.device != "cpu"
    titles = {"e_target_both_cores": "(e) target alone, both cores",
              "f_hf_assisted_both_cores": f"(f) HF assisted in-process, {'on the GPU' if gpu else 'both cores'}"}
    draft = None
    hf = {name: ModeResult() for name, wanted in (("e_target_both_cores", "e"), ("f_hf_assisted_both_cores", "f"))
          if wanted not in skip}
    tallies: dict[str, TandemTally] = {}
    passes = [None] if "g" in skip else list(args.whole_configs)
    for n, whole in enumerate(passes):
        with contextlib.ExitStack() as stack:
            client = None
            cycle = []
            if whole is not None:
                g_mode = whole_name(whole)
                running = stack.enter_context(deployment(args, str(cores[0]), str(cores[1]), pinned=False,
                                                         whole=whole))
                client = stack.enter_context(TandemClient(running.address, timeout_s=3600))
                tandem_generate(running.address, prompts, 16)
                tallies[g_mode], titles[g_mode] = TandemTally(), whole_title(whole)
                cycle.append((g_mode, None))
            # The draft loads after the services and goes before the next pass's: a
            # target service's load peaks near 10 GB, which with the bench's own
            # target and this draft beside the draft service's load overran 24 GiB.
            if "f" not in skip:  # Tandem's kernels: they verify blocks far faster than nn.Linear here
                draft = load_hf(draft_path, *config, args.device)
                hf_warm_up(target, prompts, draft, HF_ASSISTED_K)
            if n == 0 and "e" not in skip:
                hf_warm_up(target, prompts)
            cycle = [(mode, draft if mode.startswith("f") else None) for mode in hf
                     if n == 0 or mode.startswith("f")] + cycle
            if not cycle:
                continue
            for i, (prompt, ids) in enumerate(prompts.items()):
                for mode, assistant in rotated(cycle, i + n):
                    print(f"{prompt}: {titles[mode]} …", flush=True)
                    if mode in hf:
                        hf_time(hf[mode], target, prompt, ids, args.new_tokens, assistant)
                    else:
                        tallies[mode].time(client, prompt, ids, args.new_tokens, pipeline=whole[0])
        draft = cycle = assistant = None  # every reference to the draft: it goes before the next services load
        gc.collect()
    return {**{name: finish(result) for name, result in hf.items()},
            **{name: tally.result() for name, tally in tallies.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="default-target", help="target model (default: %(default)s)")
    parser.add_argument("--draft", default="default-draft", help="draft model (default: %(default)s)")
    parser.add_argument("--device", default="cpu",
                        help="cpu: two nodes emulated by pinned cores; cuda[:N]: both services on the one GPU, "
                             "each in its own process (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="dtype of Tandem's models and of the identity reference; auto = what a service picks "
                             "(tandem.cpu_kernels.auto_dtype: bfloat16 on a GPU, bfloat16 on packed layers on a CPU "
                             "with AMX, else float32 on bf16-held or fp16-weight layers) (default: %(default)s)")
    parser.add_argument("--baselines", default="",
                        help="time the target alone (a, e) in these configurations too, e.g. 'bfloat16,float32/native'; "
                             "Tandem's own and tandem.cpu_kernels.baseline_configs' others (on a CPU: float32 on its "
                             "fastest layers, float32/native, bfloat16) are always timed, and speedups are over the "
                             "fastest")
    parser.add_argument("--own-baseline-only", action="store_true",
                        help="time the target alone in Tandem's own configuration only, and take the speedups over "
                             "it: for comparing Tandem's settings run after run (A/B), not for the goals")
    parser.add_argument("--draft-args", default=None,
                        help="extra flags for the draft service (default: '--quantize auto --vocab-subset 32768' "
                             "on a CPU, none on a GPU)")
    parser.add_argument("--target-args", default="",
                        help="extra flags for the target service, e.g. '--linear bf16w'; its --linear is the first "
                             "configuration of the target alone, the identity reference (default: none)")
    parser.add_argument("--orchestrator-args", default="",
                        help="extra flags for the orchestrator, e.g. '--prefill-overlap off' (default: none)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per prompt (default: %(default)s)")
    parser.add_argument("--prompts", default=",".join(PROMPTS), help="comma-separated prompt names")
    parser.add_argument("--fixed-ks", default="2,3,4,5", help="k values of mode (c)")
    parser.add_argument("--sequential-k", type=int, default=3, help="k of mode (b)")
    parser.add_argument("--k-min", type=int, default=1, help="adaptive k lower bound")
    parser.add_argument("--k-max", type=int, default=6, help="adaptive k upper bound")
    parser.add_argument("--threads-per-node", type=int, default=1, help="torch threads per pinned service")
    parser.add_argument("--whole-configs", type=whole_configs, default=WHOLE_CONFIGS,
                        help="(g): the configurations to run Tandem in on the unpinned machine, comma-separated, "
                             "each MODE:THREADS (both services) or MODE:TARGET/DRAFT (torch threads of the target, "
                             "of the draft); each is timed and (g) is the fastest, since which wins depends on how "
                             "each model scales to two threads (default: %(default)s)")
    parser.add_argument("--skip", default="", help="comma-separated mode letters to skip (e.g. e,f)")
    parser.add_argument("--out", default=str(RESULTS / "nodes.json"), help="JSON output path")
    args = parse_args(parser, argv)
    for noisy in ("httpx", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    skip = set(args.skip.split(",")) - {""}
    gpu = args.device != "cpu"
    if gpu:
        if not torch.cuda.is_available():
            print(f"--device {args.device}: torch sees no GPU", file=sys.stderr)
            return 2
        skip |= {"e", "g"}
    if args.draft_args is None:
        args.draft_args = "" if gpu else "--quantize auto --vocab-subset 32768"
    args.dtype = resolve_dtype(args.dtype, args.device)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("bench-nodes needs two cores", file=sys.stderr)
        return 2
    where = "on the GPU" if gpu else "one pinned core"

    from transformers import AutoTokenizer

    from tandem.default_models import resolve_model

    target_path, draft_path = resolve_model(args.target), resolve_model(args.draft)
    prompts = prompt_ids(AutoTokenizer.from_pretrained(target_path), args.prompts.split(","))
    modes: dict[str, ModeResult] = {}

    # The baselines run in Tandem's configuration (the identity reference: same
    # weights, same kernels) and in every other that may decode faster here
    # (bench.hf_baselines.baselines): the speedups are taken over the fastest target
    # alone, never a slower one. The others first, one model at a time; then
    # Tandem's own, timed between the pinned Tandem modes prompt by prompt
    # (pinned_modes); then (e) in it, (f) and (g), whose ratio to (f) is a
    # goal, prompt by prompt too (unpinned_modes).
    from tandem.cpu_kernels import config_label

    configs = baselines(args.dtype, args.baselines, args.device, target_linear(args.target_args))
    if args.own_baseline_only:
        configs = configs[:1]
    for dtype, linear in configs[1:]:
        label = config_label(dtype, linear)
        suffix = "_" + label.replace("/", "_")
        target = load_hf(target_path, dtype, linear, args.device)
        print(f"(a) target alone, {where}, {label} …", flush=True)
        with on_one_core(cores, gpu):
            modes["a_target_one_core" + suffix] = hf_generate(target, prompts, args.new_tokens)
        if "e" not in skip:
            print(f"(e) target alone, both cores, {label} …", flush=True)
            modes["e_target_both_cores" + suffix] = hf_generate(target, prompts, args.new_tokens)
        del target
        gc.collect()

    label = config_label(*configs[0])
    target = load_hf(target_path, *configs[0], args.device)
    from tandem.lean import unsupported

    if len(configs) > 1 and not gpu:
        # Tandem's own configuration timed as the others just were, one after
        # another: its two timings, this one and the one between the Tandem
        # modes, show how far the machine drifted between the two phases.
        print(f"(a) target alone, {where}, {label}, timed as the other configurations were …", flush=True)
        with on_one_core(cores, gpu):
            modes["a_target_one_core_own_first"] = hf_generate(target, prompts, args.new_tokens)
    if gpu and unsupported(target) is None:
        print(f"(a) target alone, {where}, {label}, one-token forwards replayed from CUDA graphs …", flush=True)
        modes["a_target_one_core_graphs"] = lean_generate(target, prompts, args.new_tokens, args.device)
    print(f"(a)-(d), prompt by prompt: (a) target alone, {where}, {label}; Tandem on the two nodes", flush=True)
    fixed_ks = [int(k) for k in args.fixed_ks.split(",") if k]
    modes.update(pinned_modes(args, prompts, target, cores, fixed_ks))
    reference = modes["a_target_one_core"]
    print(f"(e)-(g), prompt by prompt: (e) target alone, both cores, {label}; (f) HF assisted, {label}; "
          "(g) Tandem unpinned", flush=True)
    modes.update(unpinned_modes(args, prompts, target, configs[0], draft_path, cores, skip))
    del target
    gc.collect()
    modes = dict(sorted(modes.items(), key=table_order))
    for result in modes.values():
        result.identical = count_identical(result, reference)

    payload = report(modes, args, configs, list(prompts), gpu, hf_assisted_config(HF_ASSISTED_K))
    out = Path(args.out)
    write(out, payload)
    adaptive = modes["d_pipelined_adaptive"]
    plot(out.with_suffix(".png"), modes, adaptive.accepted_per_position, adaptive.tried_per_position)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
