"""Draft length policy: a fixed k, or an adaptive k chosen per session from the
measured acceptance and the measured costs of a draft step and a verify."""
from __future__ import annotations

from dataclasses import dataclass


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """Leviathan et al. (2023): τ = (1 − α^(k+1)) / (1 − α)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


# A pre-draft proposes k + 1 tokens (the bonus guess, then k), and the draft
# service proposes at most 64 in one call (draft_service.server.MAX_DRAFT_TOKENS).
MAX_K = 63


@dataclass(frozen=True)
class KPolicyConfig:
    k: int = 4  # the fixed k, and the adaptive policy's start
    k_min: int = 1
    k_max: int = 8
    adaptive: bool = True
    ema: float = 0.3  # weight of the newest observation

    def __post_init__(self):
        if not 1 <= self.k_min <= self.k <= self.k_max <= MAX_K:
            raise ValueError(f"need 1 <= k_min <= k <= k_max <= {MAX_K}, got {self.k_min}, {self.k}, {self.k_max}")
        if not 0 < self.ema <= 1:
            raise ValueError(f"ema must be in (0, 1], got {self.ema}")


def ema(old: float | None, new: float, weight: float) -> float:
    """Exponential moving average; `weight` is the newest observation's."""
    return new if old is None else (1 - weight) * old + weight * new


class CostTable:
    """verify_ms as a function of the tokens verified (k + 1): an EMA per block
    length seen, linear interpolation between seen lengths and flat beyond them.

    No shape is assumed: on a GPU the cost is flat in k; on a CPU without native
    bf16 it grows by almost a decode per token; with packed float32 kernels it
    is a step (1-2 tokens cost the same, 4-8 tokens about 1.5x that); with
    fp16-weight kernels it is nearly flat up to 6 tokens, then steps up. Unseen
    lengths are estimated optimistically (flat above the longest seen,
    proportional below the shortest), so one gets tried once and then costs what
    it measured."""

    def __init__(self, weight: float):
        self.weight = weight
        self.ms: dict[int, float] = {}

    @property
    def n(self) -> int:
        return len(self.ms)

    def observe(self, tokens: int, ms: float) -> None:
        self.ms[tokens] = ema(self.ms.get(tokens), ms, self.weight)

    def __call__(self, tokens: int) -> float:
        if not self.ms:
            return 0.0
        if tokens in self.ms:
            return self.ms[tokens]
        below = [n for n in self.ms if n < tokens]
        above = [n for n in self.ms if n > tokens]
        if not below:  # at most proportional to the tokens: a lower bound for every kernel we know
            return self.ms[min(above)] * tokens / min(above)
        if not above:
            return self.ms[max(below)]
        lo, hi = max(below), min(above)
        return self.ms[lo] + (self.ms[hi] - self.ms[lo]) * (tokens - lo) / (hi - lo)


class StepCosts:
    """What a draft step and a verify cost on this deployment, learned from
    every request: costs belong to the hardware, acceptance to the session.
    The orchestrator keeps one per pipelining mode (a verify beside a running
    pre-draft shares the machine's memory bandwidth and costs more)."""

    def __init__(self, weight: float):
        self.weight = weight
        self.draft_step_ms: float | None = None
        self.verify = CostTable(weight)

    def observe(self, tokens_verified: int, draft_step_ms: float, verify_ms: float) -> None:
        if draft_step_ms > 0:
            self.draft_step_ms = ema(self.draft_step_ms, draft_step_ms, self.weight)
        if verify_ms > 0:
            self.verify.observe(tokens_verified, verify_ms)


class Acceptance:
    """Per-token acceptance α as a ratio of decayed sums, accepted / tried,
    each round (or request) adding its accepted tokens and its rejections.
    The mean of per-round ratios would be biased low: a round rejected at its
    first token counts as α = 0 with the weight of a round that tried k tokens
    (at α = 0.8, k = 4 it reads about 0.65)."""

    def __init__(self, weight: float):
        self.keep = 1 - weight
        self.accepted = 0.0
        self.tried = 0.0

    def add(self, accepted: int, rejected: int) -> None:
        if accepted + rejected:
            self.accepted = self.keep * self.accepted + accepted
            self.tried = self.keep * self.tried + accepted + rejected

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.tried if self.tried else None


class KPolicy:
    """Tracks α per session, reads the step costs (shared across sessions when
    given), and picks the draft lengths that maximize expected tokens per
    second. Pipelined, a fresh draft (after a miss) is on the critical path and
    a pre-draft is not, so each gets its own length: short after a miss, long
    beside a verify that would otherwise leave the draft idle. α: Acceptance."""

    def __init__(self, config: KPolicyConfig, pipelined: bool, costs: StepCosts | None = None):
        self.config = config
        self.pipelined = pipelined
        self.costs = costs if costs is not None else StepCosts(config.ema)
        self.acceptance = Acceptance(config.ema)
        self.k = config.k  # blocks drafted on the critical path (every block when sequential)
        self.k_ahead = config.k  # blocks pre-drafted beside a verify (pipelined)

    @property
    def alpha(self) -> float | None:
        return self.acceptance.alpha

    @property
    def draft_step_ms(self) -> float | None:
        return self.costs.draft_step_ms

    @property
    def verify_cost(self) -> CostTable:
        return self.costs.verify

    def observe(self, drafted: int, accepted: int, draft_step_ms: float, verify_ms: float) -> None:
        if drafted:
            self.acceptance.add(accepted, 1 if accepted < drafted else 0)
        self.costs.observe(drafted + 1, draft_step_ms, verify_ms)
        if self.config.adaptive:
            self.k, self.k_ahead = self.choose()

    def rate(self, k: int, k_ahead: int, rounds: dict[int, tuple[float, float, float]]) -> float:
        """Expected tokens per ms when fresh drafts (on the critical path, after
        a miss) are k long and pre-drafts (beside a verify) are k_ahead long;
        `rounds` maps a block length to (hit, tokens, verify ms), see choose().

        Sequential: every round drafts k, then verifies. Pipelined: a Markov
        chain over two states. A round that verifies a pre-drafted block (k_ahead)
        or a fresh one (k) is followed by a pre-drafted block when all of it is
        accepted and the bonus is guessed (≈ α^(len+1)), waiting for the
        pre-draft where it outlasts the verify; otherwise the draft restarts and
        k fresh steps come on top."""
        step = self.draft_step_ms
        if not self.pipelined:
            _, tokens, verify = rounds[k]
            return tokens / max(k * step + verify, 1e-9)

        def ms(length: int) -> float:
            hit, _, verify = rounds[length]
            return verify + hit * max(0.0, (k_ahead + 1) * step - verify) + (1 - hit) * k * step

        (hit_ahead, tokens_ahead, _), (hit_fresh, tokens_fresh, _) = rounds[k_ahead], rounds[k]
        share_ahead = hit_fresh / max(1 - hit_ahead + hit_fresh, 1e-12)  # stationary share of pre-drafted rounds
        tokens = share_ahead * tokens_ahead + (1 - share_ahead) * tokens_fresh
        return tokens / max(share_ahead * ms(k_ahead) + (1 - share_ahead) * ms(k), 1e-9)

    @property
    def measured(self) -> bool:
        """Whether a draft step and a verify have been timed in this mode."""
        return self.draft_step_ms is not None and self.verify_cost.n > 0

    def rates(self, alpha: float, ks: list[int] | None = None) -> dict[tuple[int, int], float]:
        """Expected tokens per ms of every (k, k_ahead) within the bounds at
        acceptance `alpha` (k_ahead = k when sequential), or of those drawn
        from `ks` only; needs `measured`."""
        candidates = range(self.config.k_min, self.config.k_max + 1) if ks is None else ks
        rounds = {n: (alpha ** (n + 1), expected_tokens_per_round(alpha, n), self.verify_cost(n + 1))
                  for n in candidates}
        pairs = [(k, a) for k in candidates for a in (candidates if self.pipelined else (k,))]
        return {pair: self.rate(*pair, rounds) for pair in pairs}

    def choose(self) -> tuple[int, int]:
        """(k, k_ahead) with the best rate; ties go to the shorter (less wasted drafting)."""
        if self.alpha is None or not self.measured:
            return self.k, self.k_ahead
        rates = self.rates(self.alpha)
        best = max(rates.values())
        return min((pair for pair in rates if rates[pair] >= best * (1 - 1e-6)), key=lambda p: (p[1], p[0]))


class PipelineChoice:
    """--pipeline auto: whether a request pre-drafts beside its verifies.

    A pre-draft hides a block's drafting only on a hit (the whole block
    accepted and the bonus token guessed), while the verify beside it shares
    the machine's memory bandwidth with the draft and runs slower. Per round
    of k tokens pipelining pays when h·k·s > V_beside − V_alone: on a 2-core
    AMX Xeon it did (0.418 × 3 × 35.2 = 44.1 ms against 23.8; pipelined k = 3
    1.034x sequential), on a 2-core Zen 4 it did not (0.390 × 3 × 12.8 = 14.9 ms
    against 19.1; 0.973x), bench/RESULTS.md. So each mode keeps its own step
    costs (Generation.costs) and each request takes the mode whose best (k,
    k_ahead) KPolicy.rate expects to be faster at the deployment's acceptance.
    A mode not timed yet is tried first (pipelined, then sequential), and every
    `explore_every`-th request takes the other mode, so that both modes' costs
    follow the machine as its load changes.

    Both modes are rated over the draft lengths whose verify both have timed
    (common_ks), where there are any: a CostTable guesses an unseen length
    optimistically (flat above the longest seen, proportional below the
    shortest), so over all lengths the mode timed at fewer of them would look
    faster for lengths it never ran."""

    def __init__(self, config: KPolicyConfig, costs: dict[bool, StepCosts], explore_every: int = 8):
        if explore_every < 2:
            raise ValueError(f"explore_every must be >= 2, got {explore_every}")
        self.config = config
        self.costs = costs
        self.explore_every = explore_every
        self.requests = 0
        self.acceptance = Acceptance(config.ema)  # the deployment's, over requests

    @property
    def alpha(self) -> float | None:
        return self.acceptance.alpha

    def observe(self, accepted: int, rejected_rounds: int) -> None:
        """A finished request's accepted draft tokens and rejected rounds."""
        self.acceptance.add(accepted, rejected_rounds)

    def common_ks(self) -> list[int] | None:
        """The draft lengths within the bounds whose verify (k + 1 tokens) both
        modes have timed; None where there is none."""
        seen = set(self.costs[True].verify.ms) & set(self.costs[False].verify.ms)
        ks = sorted(n - 1 for n in seen if self.config.k_min <= n - 1 <= self.config.k_max)
        return ks or None

    def expected_rate(self, pipelined: bool, ks: list[int] | None = None) -> float | None:
        """Tokens per ms of the mode's best draft lengths (drawn from `ks` when
        given); None until it was timed."""
        policy = KPolicy(self.config, pipelined, self.costs[pipelined])
        if self.alpha is None or not policy.measured:
            return None
        return max(policy.rates(self.alpha, ks).values())

    def _preferred(self) -> tuple[bool, bool]:
        """(the mode a request gets when it does not explore, whether both
        modes were timed): an untimed mode first, pipelined before sequential;
        once both were timed, the faster over common_ks."""
        ks = self.common_ks()
        rates = {mode: self.expected_rate(mode, ks) for mode in (True, False)}
        for mode in (True, False):
            if rates[mode] is None:
                return mode, False
        return rates[True] >= rates[False], True

    def preferred(self) -> bool:
        return self._preferred()[0]

    def choose(self) -> bool:
        """The next request's mode: the preferred one, or the other every
        explore_every-th request once both were timed."""
        self.requests += 1
        mode, timed = self._preferred()
        return mode != (timed and self.requests % self.explore_every == 0)
