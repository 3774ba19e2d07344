"""Raw responses of the `kubernetes` client (`_preload_content=False`).

The operator reads what it writes and watches as plain JSON: deserialising model objects
(a whole V1Pod per patch, per watch event) cost more CPU than the rest of its work. `body` and
`json_lines` are the only place that knows how such a response is wrapped and when its
connection goes back to the pool; `list_items` parses a list page one item at a time;
`written_object` and `written_metadata` read what a write answered.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Iterator
from typing import Any


def _urllib3(response: Any) -> Any:
    return getattr(response, "response", response)  # RESTResponse wraps urllib3's


def body(response: Any) -> bytes:
    """The whole body; the connection goes back to the pool. Every response read this way
    is read to its end first: a connection put back with part of a body still to arrive
    passes urllib3's check for a dropped connection, and the next request on it reads that
    part as its status line."""
    raw = _urllib3(response)
    try:
        return bytes(raw.data)
    finally:
        raw.release_conn()


def written_object(data: bytes) -> dict[str, Any]:
    """The object a write returned; empty when the answer is not an object (the write itself
    succeeded: what it returned only adds detail)."""
    try:
        found = json.loads(data)
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def written_metadata(data: bytes) -> dict[str, Any]:
    """metadata of the object a write returned; empty when the answer is not such an object."""
    meta = written_object(data).get("metadata")
    return meta if isinstance(meta, dict) else {}


_DECODER = json.JSONDecoder()
_SPACE = " \t\n\r"


def list_items(data: bytes, fields: dict[str, Any]) -> Iterator[Any]:
    """The items of a list response one at a time, each parsed as it is reached: a page of
    thousands of pods is never held parsed all at once (what that costs stays resident; see
    benchmarks/pod_index_memory.py). The list's other top-level fields (its metadata: the
    resourceVersion, the continue token) are put in `fields` as they are read, the ones after
    `items` once the items are all read. Raises ValueError where the body is no JSON object."""
    text = data.decode()
    at = _skip(text, 0)
    if text[at : at + 1] != "{":
        raise ValueError("a list response is a JSON object")
    at = _skip(text, at + 1)
    while text[at : at + 1] != "}":
        key, at = _DECODER.raw_decode(text, at)
        at = _skip(text, at)
        if text[at : at + 1] != ":":
            raise ValueError(f"expected ':' at {at}")
        at = _skip(text, at + 1)
        if key == "items" and text[at : at + 1] == "[":
            at = _skip(text, at + 1)
            while text[at : at + 1] != "]":
                item, at = _DECODER.raw_decode(text, at)
                yield item
                del item
                at = _skip(text, at)
                if text[at : at + 1] == ",":
                    at = _skip(text, at + 1)
                elif text[at : at + 1] != "]":
                    raise ValueError(f"expected ',' or ']' at {at}")
            at += 1
        else:
            value, at = _DECODER.raw_decode(text, at)
            if key != "items":  # null: no items
                fields[key] = value
        at = _skip(text, at)
        if text[at : at + 1] == ",":
            at = _skip(text, at + 1)
        elif text[at : at + 1] != "}":
            raise ValueError(f"expected ',' or '}}' at {at}")


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in _SPACE:
        at += 1
    return at


def shutdown(response: Any) -> None:
    """End a streaming response from another thread: the reader's next read ends."""
    raw = _urllib3(response)
    for name in ("shutdown", "close"):  # shutdown interrupts a read under way (urllib3 >= 2.3)
        try:
            getattr(raw, name)()
        except (AttributeError, ValueError, OSError, RuntimeError):
            # not there, or the connection is already gone back to the pool (urllib3 2.x
            # raises RuntimeError on shutdown() of a response released to it)
            continue
        return


def json_lines(response: Any, chunk: int = 65536) -> Generator[dict[str, Any], None, None]:
    """One JSON document per line, as a watch streams them. When the stream ends the
    connection goes back to the pool; when the reader stops first (an ERROR event, a stop, a
    bad line) it is closed: the rest of the stream, arriving later, would otherwise be read as
    the answer to the next request sent on it."""
    raw = _urllib3(response)
    buffer = b""
    ended = False
    try:
        for data in raw.stream(chunk, decode_content=True):
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line.strip():
                    yield json.loads(line)
        ended = True
    finally:
        if not ended:
            raw.close()
        raw.release_conn()
