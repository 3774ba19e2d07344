"""How often one report may be reconciled. Pure, with the clock passed in.

An agent may rewrite its report as fast as it likes (a bug, or a compromised node): each
rewrite is an event, and a reconcile per event would let one node drive the operator into
writing tenants' pods and Events at the agent's pace. So a report is reconciled at most once
per `interval`; events that come sooner are held, and the report's latest version is
reconciled once the interval has passed (one deferred reconcile per report, however many
events came). The pods' writes have a budget of their own (see writers.budget).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_INTERVAL = 1.0
"""Seconds between two reconciles of one report at most."""


@dataclass
class Debounce:
    """When each report was last reconciled: an event within the interval waits for the rest
    of it (the work queue merges every event meanwhile into one reconcile of the latest)."""

    interval: float = DEFAULT_INTERVAL
    _last: dict[str, float] = field(default_factory=dict)

    def wait(self, name: str, now: float) -> float:
        """Seconds before this report may be reconciled again (0: now)."""
        last = self._last.get(name)
        return 0.0 if last is None else max(0.0, last + self.interval - now)

    def ran(self, name: str, now: float) -> None:
        """A reconcile of this report starts now."""
        self._last[name] = now

    def forget(self, name: str) -> None:
        """The report is gone."""
        self._last.pop(name, None)

    def __len__(self) -> int:
        return len(self._last)
