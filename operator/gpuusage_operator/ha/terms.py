"""A replica's memories for its leadership term, replaced whole when a new term begins.

While a replica stands by, another may judge and write; what the first remembered of its own
judging and writing is then no longer the latest. So all of it lives in one object, and the
election replaces that object before the replica acts in a new term (`Terms.begin`, which
ha.election calls before it says the replica leads): nothing is reset piece by piece, and a
module never resets its own memories. The object is controller.term.Term; this module only
holds it, so that the election need not know what it is made of. Each part is handed an
accessor to its own piece (`lambda: terms.current.marks`), never the piece itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

Memories = TypeVar("Memories")


class Terms(Generic[Memories]):
    """The current term's memories (`current`), made by `fresh`."""

    def __init__(self, fresh: Callable[[], Memories]) -> None:
        self._fresh = fresh
        self.current: Memories = fresh()
        """Replaced, never changed in place, by `begin` (one assignment: a reader sees the old
        memories or the new ones, whole)."""

    def begin(self) -> None:
        """A new term: nothing remembered before it is trusted."""
        self.current = self._fresh()
