"""Failed rollouts, counted and summarised rather than printed one by one.

An environment that fails (raises, misses its deadline, returns something malformed) costs only its
own trajectory (`sao_jax.rollout.agent_loop`); a broken environment fails every one, thousands a
minute in async mode. So no failure is printed as it happens: each is counted by its message
(`FailureTally`), the first one's traceback is logged in full at DEBUG level (`sao-train --debug`
shows it: `log_first_failure`), and a run whose environment gives nothing usable for too long stops
with `DeadEnvironmentError`, one line naming the most frequent error and its count.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Iterable

from sao_jax.errors import RunError

log = logging.getLogger(__name__)


class EnvFailure(Exception):
    """An environment call that failed; ends its trajectory with `kind` and `message` in info."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class DeadEnvironmentError(RunError):
    """The environment gave no usable trajectory for longer than the run's bound allows."""


class FailureTally:
    """Failed rollouts counted by their error message."""

    def __init__(self, errors: Iterable[str] = ()):
        self.counts: collections.Counter[str] = collections.Counter(errors)

    def update(self, errors: Iterable[str]) -> None:
        self.counts.update(errors)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def most_common(self) -> tuple[str, int] | None:
        """(message, count) of the most frequent error (the first seen among equals), or None."""
        return self.counts.most_common(1)[0] if self.counts else None

    def describe(self) -> str:
        """'most often <message> (<count> times)', or 'no error recorded'."""
        top = self.most_common()
        if top is None:
            return "no error recorded"
        message, count = top
        message = " ".join(message.split())
        return f"most often {message[:300]!r}{'…' if len(message) > 300 else ''} ({count} time{'s' * (count != 1)})"


_first_logged = threading.Event()


def log_first_failure(error: BaseException, what: str) -> None:
    """Log the first rollout failure of this process with its whole traceback (chained causes too),
    at DEBUG level: once, never per rollout."""
    if _first_logged.is_set():
        return
    _first_logged.set()
    log.debug("the first failed rollout (%s), in full; later ones are only counted:", what,
              exc_info=(type(error), error, error.__traceback__))  # fmt: skip
