"""What one request's rounds keep besides the decoder's own logic: the
committed tokens with their prefix fingerprints, what each service is
believed to hold (DESIGN §2, invariant 2), and the round counters the
request stats and the metrics are made from."""
from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.backends import DraftBlock, Prefix, VerifyResult
from tandem import fingerprint

@dataclass
class RoundStats:
    rounds: int = 0
    rejected_rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    tried_per_position: list[int] = field(default_factory=list)
    rounds_per_k: list[int] = field(default_factory=list)  # index: the block's length
    k_sum: int = 0
    target_prefill: int = 0
    draft_prefill: int = 0
    cache_misses: int = 0
    predraft_hits: int = 0
    predraft_attempts: int = 0
    undrafted_rounds: int = 0  # rounds on the target alone: the draft service was unavailable
    relayed_drafts: int = 0  # blocks drafted after a verify whose drafting the target's relay began
    alternative_hits: int = 0  # rounds that took an alternative verified beside the block (a tree)
    distribution_bytes: int = 0  # under sampling: the draft distributions forwarded to the target, and shared ids
    overhead_ms: list[float] = field(default_factory=list)
    overhead_predrafted_ms: list[float] = field(default_factory=list)  # the next block was pre-drafted
    overhead_drafted_after_ms: list[float] = field(default_factory=list)  # it was drafted after the reply
    overhead_in_services_ms: list[float] = field(default_factory=list)  # of each round's overhead: the services' handlers
    handover_ms: list[float] = field(default_factory=list)  # the caller's commit and stream write, per round
    verify_ms: list[float] = field(default_factory=list)  # verifies of a block with at most one prefilled token
    draft_step_ms: list[float] = field(default_factory=list)
    tokens_per_round: list[int] = field(default_factory=list)  # committed by each round

    def record(self, block: DraftBlock, result: VerifyResult) -> None:
        k = len(block.tokens)
        self.rounds += 1
        self.tokens_per_round.append(result.accepted + 1 + len(result.more_tokens))
        self.alternative_hits += bool(result.more_tokens)
        self.distribution_bytes += sum(d.ByteSize() for d in block.distributions) + len(block.distribution_ids)
        self.drafted += k
        self.accepted += result.accepted
        self.rejected_rounds += result.accepted < k
        self.k_sum += k
        self.rounds_per_k.extend([0] * (k + 1 - len(self.rounds_per_k)))
        self.rounds_per_k[k] += 1
        for counts in (self.accepted_per_position, self.tried_per_position):
            counts.extend([0] * (k - len(counts)))
        for i in range(result.accepted):
            self.accepted_per_position[i] += 1
        for i in range(min(result.accepted + 1, k)):
            self.tried_per_position[i] += 1


class Committed:
    """A session's committed tokens with the fingerprint of every prefix."""

    def __init__(self, tokens: list[int]):
        self.tokens = list(tokens)
        self.fps = fingerprint.prefix_table(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix(self, length: int, extra: list[int] = ()) -> Prefix:
        fp = self.fps[length - 1] if length else fingerprint.EMPTY
        return Prefix(length + len(extra), fingerprint.extend(fp, extra))

    def extend(self, tokens: list[int]) -> None:
        start = self.fps[-1] if self.fps else fingerprint.EMPTY
        self.fps.extend(fingerprint.prefix_table(tokens, start))
        self.tokens.extend(tokens)


@dataclass
class ServiceView:
    """What a service is believed to hold: committed[:length] + tail (speculative)."""

    length: int
    tail: list[int] = field(default_factory=list)

    def settle(self, committed_before: int, newly: list[int]) -> None:
        """After `newly` was committed at committed_before: keep what still matches."""
        if self.tail:
            assert self.length == committed_before
            common = 0
            for held, new in zip(self.tail, newly):
                if held != new:
                    break
                common += 1
            self.length += common
            self.tail = []
        else:
            self.length = min(self.length, committed_before)
