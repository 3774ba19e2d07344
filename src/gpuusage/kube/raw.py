"""Raw responses of the `kubernetes` client (`_preload_content=False`).

The operator reads what it writes and watches as plain JSON: deserialising model objects
(a whole V1Pod per patch, per watch event) cost more CPU than the rest of its work. `body` and
`json_lines` are the only place that knows how such a response is wrapped and when its
connection goes back to the pool; `written_object` and `written_metadata` read what a write
answered.
"""

from __future__ import annotations

import json
from collections.abc import Generator
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


def shutdown(response: Any) -> None:
    """End a streaming response from another thread: the reader's next read ends."""
    raw = _urllib3(response)
    for name in ("shutdown", "close"):  # shutdown interrupts a read under way (urllib3 >= 2.3)
        try:
            getattr(raw, name)()
        except (AttributeError, ValueError, OSError):
            continue  # not there, or the connection is already gone back to the pool
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
