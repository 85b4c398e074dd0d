"""Pieces shared by the benchmarks: the fixed prompts, a mode's result, running
Tandem over a deployment, and the JSON/table output. The in-process Hugging Face
baselines are in bench.hf_baselines."""
from __future__ import annotations

import json
import logging
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from orchestrator.policy import expected_tokens_per_round

log = logging.getLogger(__name__)
RESULTS = Path(__file__).parent / "results"

PROMPTS = {
    "code-1": "Write a Python function that merges two sorted lists into one sorted list, with a docstring.",
    "code-2": "Implement a binary search tree class in Python with insert, search and in-order traversal.",
    "prose-1": "Explain in a few paragraphs why the sky is blue, for a curious twelve-year-old.",
    "prose-2": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def prompt_ids(tokenizer, names: list[str]) -> dict[str, list[int]]:
    """Each prompt as one user turn under the model's chat template."""
    return {
        name: tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[name]}],
                                            tokenize=True, add_generation_prompt=True, return_dict=False)
        for name in names
    }


@dataclass
class ModeResult:
    tok_s: float = 0.0
    tokens: int = 0
    seconds: float = 0.0
    identical: int = 0  # prompts whose tokens equal the target alone
    prompts: int = 0
    acceptance_rate: float | None = None
    tokens_per_round: float | None = None  # committed, an alternative's extra token included
    block_tokens_per_round: float | None = None  # accepted + 1 a round: what τ predicts for the block alone
    theory_tokens_per_round: float | None = None
    mean_k: float | None = None
    predraft_hit_rate: float | None = None
    overhead_ms_per_round_p50: float | None = None
    overhead_ms_predrafted_p50: float | None = None  # rounds whose next block was pre-drafted: one call
    overhead_ms_drafted_after_p50: float | None = None  # the next block drafted after the reply: two calls
    overhead_in_services_ms_p50: float | None = None  # of the overhead: the services' handlers beyond compute
    handover_ms_per_round_p50: float | None = None  # Redis commit + stream write, off the critical path
    verify_ms_p50: float | None = None  # the target's compute per verify (median over prompts of per-prompt medians)
    draft_step_ms_p50: float | None = None
    first_token_ms_p50: float | None = None  # time to first token, the orchestrator's own (median over prompts)
    ceiling_tok_s: float | None = None  # tokens/round over verify time: if drafting and overhead cost nothing
    accepted_per_position: list[int] = field(default_factory=list)
    tried_per_position: list[int] = field(default_factory=list)
    rounds_per_k: list[int] = field(default_factory=list)  # index: block length
    pipelined_prompts: int | None = None  # Tandem: prompts whose request pre-drafted (SpeculationStats.pipelined)
    # Tandem: of the blocks drafted after a verify's reply, the fraction whose
    # drafting the target's relay began (SpeculationStats.relayed_drafts; --relay)
    relayed_draft_rate: float | None = None
    # Tandem: the fraction of rounds that took an alternative verified beside
    # their block (SpeculationStats.alternative_hits; --tree-width)
    alternative_hit_rate: float | None = None
    # Tandem: the requests' re-syncs (a service that missed its cache: the
    # committed tokens sent again, a prefill's time), and rounds on the target
    # alone while the draft was unavailable. 0 in a sound run.
    cache_misses: int | None = None
    undrafted_rounds: int | None = None
    outputs: dict = field(default_factory=dict)


def theory_tokens_per_round(alpha: float, rounds_per_k: list[int]) -> float:
    """Leviathan's τ(α, k) averaged over the rounds' block lengths (adaptive k
    mixes them; τ at the mean k is not the mean τ)."""
    rounds = sum(rounds_per_k)
    if not rounds:
        return 0.0
    return sum(n * expected_tokens_per_round(alpha, k) for k, n in enumerate(rounds_per_k)) / rounds


def tandem_generate(address: str, prompts: dict[str, list[int]], new_tokens: int, **params) -> ModeResult:
    """Greedy generation through the orchestrator, with the request stats folded in."""
    from tandem.client import TandemClient

    tally = TandemTally()
    with TandemClient(address, timeout_s=3600) as client:
        for name, ids in prompts.items():
            tally.time(client, name, ids, new_tokens, **params)
    return tally.result()


def _add_counts(counts: list[int], new) -> None:
    counts.extend([0] * (len(new) - len(counts)))
    for i, n in enumerate(new):
        counts[i] += n


@dataclass
class TandemTally:
    """One Tandem mode's prompts, timed one at a time (possibly between other
    modes' runs), and their request stats folded into a ModeResult."""

    totals: ModeResult = field(default_factory=ModeResult)
    rounds: int = 0
    rejected: int = 0
    accepted: int = 0
    hits: int = 0
    attempts: int = 0
    k_sum: float = 0.0
    rounds_per_k: list[int] = field(default_factory=list)
    per_position: list[int] = field(default_factory=list)
    tried: list[int] = field(default_factory=list)
    overheads: list[float] = field(default_factory=list)
    predrafted: list[float] = field(default_factory=list)
    drafted_after: list[float] = field(default_factory=list)
    in_services: list[float] = field(default_factory=list)
    handovers: list[float] = field(default_factory=list)
    verifies: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    first_tokens: list[float] = field(default_factory=list)
    pipelined: int = 0
    relayed: int = 0
    alternative_hits: int = 0
    cache_misses: int = 0
    undrafted: int = 0

    def time(self, client, name: str, ids: list[int], new_tokens: int, **params) -> None:
        """One prompt through the orchestrator, greedy, timed and folded in."""
        start = time.perf_counter()
        out = client.generate(prompt_ids=ids, max_tokens=new_tokens, **params)
        elapsed = time.perf_counter() - start
        s = out.stats
        r = self.totals
        r.outputs[name] = out.token_ids
        r.tokens += len(out.token_ids)
        r.seconds += elapsed
        self.rounds += s.rounds
        self.rejected += s.rejected_rounds
        self.accepted += s.accepted_tokens
        self.hits += s.predraft_hits
        self.pipelined += s.pipelined
        self.relayed += s.relayed_drafts
        self.alternative_hits += s.alternative_hits
        self.cache_misses += s.cache_misses
        self.undrafted += s.undrafted_rounds
        self.attempts += s.predraft_attempts
        self.k_sum += s.mean_k * s.rounds
        _add_counts(self.rounds_per_k, s.rounds_per_k)
        _add_counts(self.per_position, s.accepted_per_position)
        _add_counts(self.tried, s.tried_per_position)
        self.overheads.append(s.overhead_ms_p50)
        if s.overhead_ms_p50_predrafted:
            self.predrafted.append(s.overhead_ms_p50_predrafted)
        if s.overhead_ms_p50_drafted_after:
            self.drafted_after.append(s.overhead_ms_p50_drafted_after)
        if s.overhead_in_services_ms_p50:
            self.in_services.append(s.overhead_in_services_ms_p50)
        self.handovers.append(s.handover_ms_p50)
        if s.verify_ms_p50:
            self.verifies.append(s.verify_ms_p50)
        if s.draft_step_ms_p50:
            self.steps.append(s.draft_step_ms_p50)
        if s.first_token_ms:
            self.first_tokens.append(s.first_token_ms)
        log.info("%s: %d tokens in %.1fs, acceptance %.2f", name, len(out.token_ids), elapsed, out.acceptance_rate)

    def result(self) -> ModeResult:
        r = self.totals
        rounds = self.rounds
        r.prompts = len(r.outputs)
        r.tok_s = r.tokens / r.seconds if r.seconds else 0.0
        r.mean_k = self.k_sum / rounds if rounds else 0.0
        # Per-token acceptance: each round is a run of accepted tokens ended by at
        # most one rejection (Leviathan et al.'s i.i.d. model).
        total = self.accepted + self.rejected
        alpha = self.accepted / total if total else 0.0
        r.acceptance_rate = alpha
        # What the rounds committed (accepted + 1 each, one more where an alternative
        # was taken, which τ of the block alone does not count); the tokens kept
        # are fewer where max_tokens cut a prompt's last round.
        r.tokens_per_round = (self.accepted + rounds + self.alternative_hits) / rounds if rounds else 0.0
        r.block_tokens_per_round = (self.accepted + rounds) / rounds if rounds else 0.0
        r.alternative_hit_rate = self.alternative_hits / rounds if rounds else None
        r.theory_tokens_per_round = theory_tokens_per_round(alpha, self.rounds_per_k)
        r.predraft_hit_rate = self.hits / self.attempts if self.attempts else None
        r.overhead_ms_per_round_p50 = median(self.overheads)
        r.overhead_ms_predrafted_p50 = median(self.predrafted)
        r.overhead_ms_drafted_after_p50 = median(self.drafted_after)
        r.overhead_in_services_ms_p50 = median(self.in_services)
        r.handover_ms_per_round_p50 = median(self.handovers)
        r.verify_ms_p50 = median(self.verifies)
        r.draft_step_ms_p50 = median(self.steps)
        r.first_token_ms_p50 = median(self.first_tokens)
        if r.verify_ms_p50 and rounds:
            r.ceiling_tok_s = r.tokens_per_round / r.verify_ms_p50 * 1e3
        r.accepted_per_position = self.per_position
        r.tried_per_position = self.tried
        r.rounds_per_k = self.rounds_per_k
        r.pipelined_prompts = self.pipelined
        r.cache_misses, r.undrafted_rounds = self.cache_misses, self.undrafted
        # Every round but a prompt's last is followed by a pre-draft hit or a draft after its reply.
        drafted_after = rounds - r.prompts - self.hits
        r.relayed_draft_rate = self.relayed / drafted_after if drafted_after > 0 else None
        return r


def cut(ratio: float) -> float:
    """A ratio cut to two decimals, never rounded up (1.4298 -> 1.42)."""
    return math.floor(ratio * 100) / 100


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def count_identical(result: ModeResult, reference: ModeResult) -> int:
    return sum(result.outputs.get(name) == ids for name, ids in reference.outputs.items())


def machine() -> dict:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    # The baselines run in this process under these (unset: libgomp's defaults);
    # Tandem's services set their own when unset (tandem.cli).
    openmp = {name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return {"platform": platform.platform(), "processor": platform.processor(), "cpus": torch.get_num_threads(),
            "torch": torch.__version__, "gpu": gpu, "openmp_env": openmp}


def pair_flags(parser) -> None:
    """--target, --draft, --draft-args and --dtype: the model pair of a probe's deployments."""
    parser.add_argument("--target", default="default-target", help="target model (default: %(default)s)")
    parser.add_argument("--draft", default="default-draft", help="draft model (default: %(default)s)")
    parser.add_argument("--draft-args", default="--quantize auto --vocab-subset 32768",
                        help="extra draft service flags (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="both model services' --dtype (default: %(default)s, bfloat16 on a GPU or an AMX CPU). "
                             "Sides compared token for token match reliably in float32 only: in bfloat16 where a "
                             "block ends moves the rounding, and adaptive k ends blocks by measured times")


def request_flags(parser, reps: int, new_tokens: int = 64) -> None:
    """--prompts, --new-tokens and --reps: which of PROMPTS a probe sends, the
    tokens of each reply, and the passes over them."""
    parser.add_argument("--prompts", default=",".join(PROMPTS), help="prompt names (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=new_tokens, help="tokens per request (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=reps, help="passes over the prompts (default: %(default)s)")


def model_flags(args, role: str) -> list[str]:
    """A model service's --model and --dtype from pair_flags' arguments, with
    the draft's --draft-args (role: "target" or "draft")."""
    if role == "draft":
        return ["--model", args.draft, "--dtype", args.dtype, *args.draft_args.split()]
    return ["--model", args.target, "--dtype", args.dtype]


def pair_record(args) -> dict:
    """What a probe's JSON records of pair_flags' pair."""
    return dict(target=args.target, draft=args.draft, draft_args=args.draft_args, dtype=args.dtype)


def pair_deployment(args, orchestrator_args: list[str], service_args: list[str] = ()):
    """A deployment of pair_flags' pair, each model service with --threads
    and `service_args`, and an orchestrator with these flags
    (tandem.launch.Deployment)."""
    from tandem.launch import Deployment, Service

    return Deployment(Service("target", [*model_flags(args, "target"), *service_args], threads=args.threads),
                      Service("draft", [*model_flags(args, "draft"), *service_args], threads=args.threads),
                      orchestrator_args)


def parse_args(parser, argv=None):
    """A probe's arguments, with INFO logging on: what every probe's main starts with."""
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return args


def write(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)))
    log.info("wrote %s", path)


def table(rows: list[tuple[str, ModeResult]], baseline: ModeResult) -> str:
    lines = [f"{'mode':<34}{'tok/s':>8}{'vs base':>9}{'α':>7}{'tok/rnd':>9}{'τ(α,k)':>8}{'k':>6}{'hit':>6}{'ovh ms':>8}{'hand':>6}"
             f"{'verify':>8}{'step':>6}{'ceil':>7}{'ttft':>7}{'same':>7}"]

    def fmt(value, spec):
        return format(value, spec) if value is not None else "-".rjust(int(spec.split(".")[0]))

    for name, r in rows:
        lines.append(
            f"{name:<34}{r.tok_s:>8.2f}{cut(r.tok_s / baseline.tok_s):>8.2f}x{fmt(r.acceptance_rate, '7.2f')}"
            f"{fmt(r.block_tokens_per_round, '9.2f')}{fmt(r.theory_tokens_per_round, '8.2f')}{fmt(r.mean_k, '6.1f')}"
            f"{fmt(r.predraft_hit_rate, '6.2f')}{fmt(r.overhead_ms_per_round_p50, '8.1f')}{fmt(r.handover_ms_per_round_p50, '6.1f')}"
            f"{fmt(r.verify_ms_p50, '8.0f')}{fmt(r.draft_step_ms_p50, '6.0f')}{fmt(r.ceiling_tok_s, '7.2f')}"
            f"{fmt(r.first_token_ms_p50, '7.0f')}{r.identical:>5}/{r.prompts}"
        )
    return "\n".join(lines)
