"""What the orchestrator does while the draft service is down: it decodes on the
target alone, one token a round, and calls the draft again after a backoff.

The draft only proposes tokens; the target decides every one of them. So a
round without a draft commits what it would have committed with one (under
greedy decoding the same token; under sampling a token from the target's
distribution), only fewer of them. One breaker serves every session of the
orchestrator: the draft service is one service.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

log = logging.getLogger(__name__)


class DraftBreaker:
    """Closed while draft calls succeed. A failed call opens it: no draft call
    goes out for `backoff_s`, doubling with each further failure up to
    `max_backoff_s`; the first call after that is the retry, and its success
    closes the breaker. Disabled (`enabled=False`), it never opens: a failed
    draft call fails the request. Paused, no draft call goes out at all: the
    orchestrator started without its draft service and has not paired it yet."""

    def __init__(self, enabled: bool = True, backoff_s: float = 0.5, max_backoff_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        if not 0 < backoff_s <= max_backoff_s:
            raise ValueError(f"need 0 < backoff_s <= max_backoff_s, got {backoff_s}, {max_backoff_s}")
        self.enabled = enabled
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.clock = clock
        self.failures = 0  # consecutive failed draft calls
        self.retry_at = 0.0
        self.paused = False

    @property
    def open(self) -> bool:
        return self.failures > 0 or self.paused

    def allows(self) -> bool:
        """Whether a draft call may go out now."""
        return not self.paused and (not self.failures or self.clock() >= self.retry_at)

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        """Drafting from the next round on."""
        self.paused = False
        self.failures = 0

    def trip(self, err: Exception) -> bool:
        """After a draft call failed with `err` (the service down or past its
        deadline): True when decoding goes on without the draft."""
        if not self.enabled:
            return False
        self.failures += 1
        backoff = min(self.backoff_s * 2 ** (self.failures - 1), self.max_backoff_s)
        self.retry_at = self.clock() + backoff
        if self.failures == 1:
            log.warning("draft service unavailable (%s): decoding on the target alone, retrying in %.1f s", err, backoff)
        else:
            log.info("draft service still unavailable (%s): retrying in %.1f s", err, backoff)
        return True

    def reset(self) -> None:
        """After a draft call succeeded."""
        if self.failures:
            log.warning("draft service back after %d failed calls: drafting again", self.failures)
        self.failures = 0
