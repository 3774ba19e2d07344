"""Which Events to write, as client-go's recorder decides it. Pure.

A pod whose process starts and ends every minute would otherwise get two Events a minute, each
a new object in etcd and a new line in `kubectl describe`. Two rules, both client-go's:

* **Series**: an Event identical to one written for the same object within SERIES_WINDOW (same
  reason, type and note) is not written again: the earlier one's `series` (count, last
  observed) is updated, which `kubectl get events` shows as its count.
* **Per-object rate**: each object has a bucket of BURST writes, refilled one every REFILL;
  an Event with the bucket empty is dropped (counted). A crash-looping pod gets at most BURST
  writes at once and then one every REFILL, whatever its cycle.

The book forgets an object once its series have aged out and its bucket is full again, so it
holds only objects with recent Events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

SERIES_WINDOW = timedelta(minutes=10)
BURST = 25
REFILL = timedelta(minutes=5)
PRUNE_EVERY = 64

EventKey = tuple[str, str, str, str]
"""(object, reason, type, note): what makes two Events identical."""


@dataclass(frozen=True)
class Write:
    kind: Literal["new", "series", "drop"]
    name: str = ""
    """For series: the Event to update."""
    count: int = 1
    """For series: its count after this one."""


@dataclass(slots=True)
class _Series:
    name: str
    count: int
    last: datetime


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: datetime


@dataclass
class EventBook:
    series_window: timedelta = SERIES_WINDOW
    burst: int = BURST
    refill: timedelta = REFILL
    _series: dict[EventKey, _Series] = field(default_factory=dict)
    _buckets: dict[str, _Bucket] = field(default_factory=dict)
    _calls: int = 0

    def write_for(self, key: EventKey, now: datetime) -> Write:
        """What to do about an Event with this key now; a write taken is counted at once."""
        self._calls += 1
        if self._calls % PRUNE_EVERY == 0:
            self.prune(now)
        bucket = self._bucket(key[0], now)
        if bucket.tokens < 1:
            return Write("drop")
        bucket.tokens -= 1
        found = self._series.get(key)
        if found is not None and now - found.last <= self.series_window:
            found.count += 1
            found.last = now
            return Write("series", found.name, found.count)
        return Write("new")

    def written(self, key: EventKey, name: str, now: datetime) -> None:
        """A new Event `name` was created for `key`: identical ones join its series."""
        self._series[key] = _Series(name, 1, now)

    def lost(self, key: EventKey) -> None:
        """The series' Event is gone (expired, deleted): the next one starts anew."""
        self._series.pop(key, None)

    def _bucket(self, subject: str, now: datetime) -> _Bucket:
        found = self._buckets.get(subject)
        if found is None:
            found = self._buckets[subject] = _Bucket(float(self.burst), now)
        else:
            gained = (now - found.at) / self.refill
            found.tokens = min(float(self.burst), found.tokens + gained)
            found.at = now
        return found

    def prune(self, now: datetime) -> None:
        """Forget series that aged out and objects whose bucket is full again."""
        self._series = {k: s for k, s in self._series.items() if now - s.last <= self.series_window}
        live = {k[0] for k in self._series}
        for subject, bucket in list(self._buckets.items()):
            full = bucket.tokens + (now - bucket.at) / self.refill >= self.burst
            if full and subject not in live:
                del self._buckets[subject]

    def __len__(self) -> int:
        return len(self._series) + len(self._buckets)
