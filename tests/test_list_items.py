"""A list page's items parsed one at a time, and the memory a list freed given back."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpuusage import memory
from gpuusage.kube import raw
from gpuusage_operator.informers.informer import Informer


def items_of(body: str) -> tuple[list[Any], dict[str, Any]]:
    fields: dict[str, Any] = {}
    return list(raw.list_items(body.encode(), fields)), fields


@pytest.mark.parametrize(
    "page",
    [
        {"kind": "PodList", "metadata": {"resourceVersion": "7", "continue": "c"}, "items": []},
        {"items": [{"a": 1}, {"b": [1, "]", {"c": "}"}]}], "metadata": {"resourceVersion": "9"}},
        {"apiVersion": "v1", "items": [{"name": 'ünï \u2603 \\" [x]'}], "metadata": {}},
        {"items": None, "metadata": {"resourceVersion": "1"}},
        {},
    ],
)
def test_items_and_fields_as_json_loads_reads_them(page: dict[str, Any]) -> None:
    for text in (
        json.dumps(page),
        json.dumps(page, indent=2),
        json.dumps(page, separators=(",", ":")),
    ):
        items, fields = items_of(text)
        assert items == (page.get("items") or [])
        assert fields == {k: v for k, v in page.items() if k != "items"}


@pytest.mark.parametrize(
    "body",
    ["", "[]", '{"items": [1, 2', '{"items": [1 2]}', '{"a" 1}', '{"a": 1 "b": 2}', "{'a': 1}"],
)
def test_what_is_no_list_is_refused(body: str) -> None:
    with pytest.raises(ValueError, match=r"(?i)expect|json object"):  # json's errors too
        items_of(body)


def test_each_item_is_parsed_when_it_is_reached() -> None:
    """One item at a time: the first is handed over before the second is parsed (a page
    parsed whole would fail before giving any)."""
    body = b'{"metadata": {}, "items": [{"n": 1}, {"n": 2 BROKEN}]}'
    reader = raw.list_items(body, {})
    assert next(reader) == {"n": 1}
    with pytest.raises(ValueError, match="Expecting"):
        next(reader)


def test_memory_is_given_back_after_each_list() -> None:
    assert memory.trim() is True, "glibc has malloc_trim (this machine's C library)"
    trims: list[int] = []
    pages = [{"metadata": {"resourceVersion": "3"}, "items": [{"metadata": {"uid": "u"}}]}]

    class Raw:
        def __init__(self, data: bytes) -> None:
            self.data = data

        def release_conn(self) -> None:
            pass

    class State:
        def __init__(self) -> None:
            self.seen: list[str] = []

        def apply(self, event_type: str, obj: Any) -> None:
            self.seen.append(obj["metadata"]["uid"])

        def ids(self) -> set[str]:
            return set(self.seen)

        def __len__(self) -> int:
            return len(self.seen)

    informer = Informer(
        "thing",
        lambda limit, token: Raw(json.dumps(pages[0]).encode()),
        lambda version, idle: None,
        State,
        trim=lambda: trims.append(1),
    )
    assert informer.list_all() == "3"
    assert informer.state.seen == ["u"]
    assert trims == [1]
