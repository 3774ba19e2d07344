"""Label selectors as Kubernetes reads them: matching, and the string form `kubectl -l` takes.

A selector that is absent selects everything; so does an empty one. Requirements are ANDed:
`In` and `NotIn` compare the label's value (NotIn also matches an object without the label),
`Exists` and `DoesNotExist` its presence. The string form is the one the apiserver parses for
`labelSelector`: `key=value`, `key==value`, `key!=value`, `key in (a,b)`, `key notin (a,b)`,
`key`, `!key`, joined by commas. Its `>` and `<` have no place in a LabelSelector and are
refused, as is anything else it would not parse.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from gpuusage.api.policy import LabelSelector, SelectorRequirement

_KEY = r"(?:[a-z0-9](?:[-a-z0-9.]*[a-z0-9])?/)?[a-z0-9A-Z](?:[-a-z0-9A-Z_.]*[a-z0-9A-Z])?"
"""A label key: an optional prefix (a lowercase DNS subdomain) and a name."""
_VALUE = r"(?:[a-z0-9A-Z](?:[-a-z0-9A-Z_.]*[a-z0-9A-Z])?)?"
_SET = re.compile(rf"\s*({_KEY})\s+(in|notin)\s*\(([^()]*)\)\s*")
_EQUAL = re.compile(rf"\s*({_KEY})\s*(==|=|!=)\s*({_VALUE})\s*")
_EXISTS = re.compile(rf"\s*(!?)\s*({_KEY})\s*")
_VALUE_ONLY = re.compile(rf"\s*({_VALUE})\s*")


class SelectorError(ValueError):
    """A selector string the apiserver would not parse; the message says where."""


def requirement_holds(requirement: SelectorRequirement, labels: Mapping[str, str]) -> bool:
    present = requirement.key in labels
    if requirement.operator == "Exists":
        return present
    if requirement.operator == "DoesNotExist":
        return not present
    inside = present and labels[requirement.key] in requirement.values
    return inside if requirement.operator == "In" else not inside


def selects(selector: LabelSelector | None, labels: Mapping[str, str]) -> bool:
    """Whether the selector picks an object with these labels (absent: everything)."""
    if selector is None:
        return True
    if any(labels.get(k) != v for k, v in selector.match_labels.items()):
        return False
    return all(requirement_holds(r, labels) for r in selector.match_expressions)


def parse_selector(text: str) -> LabelSelector:
    """The LabelSelector a `kubectl -l` string stands for (empty: selects everything)."""
    selector = LabelSelector()
    for part in _split(text):
        selector.match_expressions.append(_requirement(part))
    return selector


def _split(text: str) -> list[str]:
    """The requirements, split at the commas outside parentheses."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth not in (0, 1):
            raise SelectorError(f"{text!r}: unbalanced parentheses")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise SelectorError(f"{text!r}: unbalanced parentheses")
    parts.append(current)
    if len(parts) == 1 and not parts[0].strip():
        return []
    if any(not p.strip() for p in parts):
        raise SelectorError(f"{text!r}: an empty requirement (two commas, or one at an end)")
    return parts


def _key(key: str, part: str) -> str:
    """The key, held to the apiserver's bounds: a prefix of at most 253 characters, a name of
    at most 63."""
    prefix, _, name = key.rpartition("/")
    if len(prefix) > 253 or len(name) > 63:
        raise SelectorError(f"{part.strip()!r}: the key's prefix or name is too long")
    return key


def _value(value: str, part: str) -> str:
    if len(value) > 63:
        raise SelectorError(f"{part.strip()!r}: a label value is at most 63 characters")
    return value


def _requirement(part: str) -> SelectorRequirement:
    found = _SET.fullmatch(part)
    if found:
        key, op, listed = found.groups()
        values = [v.strip() for v in listed.split(",")]
        if any(not _VALUE_ONLY.fullmatch(v) for v in values) or values == [""]:
            raise SelectorError(f"{part.strip()!r}: a value is not a label value")
        operator = "In" if op == "in" else "NotIn"
        values = [_value(v, part) for v in values]
        return SelectorRequirement(
            key=_key(key, part), operator=operator, values=sorted(set(values))
        )
    found = _EQUAL.fullmatch(part)
    if found:
        key, op, value = found.groups()
        operator = "NotIn" if op == "!=" else "In"
        return SelectorRequirement(
            key=_key(key, part), operator=operator, values=[_value(value, part)]
        )
    found = _EXISTS.fullmatch(part)
    if found:
        negated, key = found.groups()
        operator = "DoesNotExist" if negated else "Exists"
        return SelectorRequirement(key=_key(key, part), operator=operator)
    raise SelectorError(
        f"{part.strip()!r} is not a label requirement (key=value, key!=value, key in (a,b), "
        "key notin (a,b), key or !key)"
    )
