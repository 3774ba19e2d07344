"""The smallest JSON merge patch (RFC 7386) from one document to another.

Writers that know what is stored send only what changed: a status whose only news is a new
observedGeneration costs a few hundred bytes instead of the whole status. Lists are replaced
whole by a merge patch, so a changed list is sent whole; a key that is gone becomes a null,
which is how a merge patch removes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_ABSENT = object()


def merge_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that turns `old` into `new` (empty when they are equal)."""
    patch: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key, _ABSENT)
        if before == value:
            continue
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            patch[key] = merge_diff(before, value)
        else:
            patch[key] = value
    for key in old.keys() - new.keys():
        patch[key] = None
    return patch
