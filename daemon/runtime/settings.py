"""The runtime's tunables: the `[runtime]` section of the config, and the hold flag."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Settings:
    """The runtime's tunables (the `[runtime]` section of the config)."""

    max_concurrent_steps: int = 64
    retry_initial_s: float = 1.0
    retry_max_s: float = 300.0
    #: 0 retries forever.
    retry_max_attempts: int = 0
    #: Workflows kept loaded in memory after their actor went idle.
    cache_size: int = 10_000
    #: Start with every workflow held (`workflowd --hold`) until released.
    hold: bool = False
    #: What `gc` keeps by default (`[store] keep_finished_days`; 0: retention off).
    keep_finished_days: float = 30.0

    def backoff(
        self, attempt: int, initial_s: float | None = None, max_s: float | None = None
    ) -> float:
        """Return the delay before retry number `attempt` (1-based), doubling up to the cap."""
        initial = self.retry_initial_s if initial_s is None else initial_s
        cap = self.retry_max_s if max_s is None else max_s
        return float(min(initial * 2 ** max(0, attempt - 1), cap))
