"""One request's measurements, fed to the OpenTelemetry instruments
(tandem.telemetry.Instruments)."""
from __future__ import annotations

import time

from orchestrator.rounds import RoundStats
from tandem import telemetry
from tandem.v1 import tandem_pb2


class RequestMetrics:
    """Feeds one request's measurements to the instruments: per-round values a
    round at a time while the next round computes, counters once at the end,
    from the same RoundStats the Completion reports. (The services record
    their compute times themselves.)"""

    def __init__(self, instruments: telemetry.Instruments):
        self.i = instruments
        self.done = dict(tokens_per_round=0, overhead_ms=0)
        self.last_chunk = 0.0

    def streamed(self, tokens: int, first_token_ms: float) -> None:
        """After a chunk of `tokens` went out."""
        if not self.i.enabled:
            return
        now = time.perf_counter()
        if self.last_chunk:
            self.i.inter_token_latency.record((now - self.last_chunk) / tokens)
        else:
            self.i.time_to_first_token.record(first_token_ms * 1e-3)
        self.last_chunk = now

    def record_rounds(self, stats: RoundStats) -> None:
        if not self.i.enabled:
            return
        for name, histogram, scale in (("tokens_per_round", self.i.tokens_per_round, 1),
                                       ("overhead_ms", self.i.round_overhead, 1e-3)):
            values = getattr(stats, name)
            for value in values[self.done[name]:]:
                histogram.record(max(value, 0) * scale)  # an overhead is < 0 when timings overlap
            self.done[name] = len(values)

    def finish(self, stats: RoundStats, finish, completion_tokens: int, prompt_tokens: int, cached: int) -> None:
        if not self.i.enabled:
            return
        self.record_rounds(stats)
        i = self.i
        i.requests.add(1, {"finish_reason": finish_label(finish)})
        i.completion_tokens.add(completion_tokens)
        i.prompt_tokens.add(prompt_tokens)
        i.cached_prompt_tokens.add(cached)
        i.drafts.add(stats.rounds)
        i.draft_tokens.add(stats.drafted)
        i.accepted_tokens.add(stats.accepted)
        for position, accepted in enumerate(stats.accepted_per_position):
            i.accepted_per_position.add(accepted, {"position": position})
        i.predraft_attempts.add(stats.predraft_attempts)
        i.predraft_hits.add(stats.predraft_hits)
        i.undrafted_rounds.add(stats.undrafted_rounds)
        i.alternative_rounds.add(stats.alternative_hits)
        i.draft_distribution_bytes.add(stats.distribution_bytes)


def finish_label(finish) -> str:
    """The finish reason as a label: length, eos, stop, context, or unfinished
    (the request failed or was cancelled)."""
    if finish == tandem_pb2.FINISH_REASON_UNSPECIFIED:
        return "unfinished"
    return tandem_pb2.FinishReason.Name(finish).removeprefix("FINISH_REASON_").lower()
