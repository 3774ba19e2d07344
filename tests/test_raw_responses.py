"""Connections put back in urllib3's pool carry nothing of the last answer.

A connection returned with part of a body still on its way passes urllib3's check for a dropped
connection (nothing to read yet); the next request on it then reads that part as its status line
(`BadStatusLine('..."devices":[...]}}]}')`, seen once on CI as a false API outage). The server
here makes that race certain: it holds back the rest of each first answer until the client has
sent its next request on the same connection, or until HOLD seconds passed without one.
"""

from __future__ import annotations

import json
import select
import socket
import threading
from collections.abc import Iterator

import pytest
import urllib3

from gpuusage.kube import raw
from gpuusage_operator.informers.informer import OptionalWatch

HOLD = 0.5

SLICES = json.dumps(
    {"kind": "ResourceSliceList", "items": [{"spec": {"devices": [{"name": "gpu-0"}]}}]}
).encode()


def _read_request(conn: socket.socket, pending: bytes) -> tuple[bytes, bytes] | None:
    """(request line, what came after the request) or None when the client went away."""
    while b"\r\n\r\n" not in pending:
        data = conn.recv(65536)
        if not data:
            return None
        pending += data
    head, rest = pending.split(b"\r\n\r\n", 1)
    return head.split(b"\r\n", 1)[0], rest


def _next_request_or_hold(conn: socket.socket) -> bytes:
    """What the client sends next within HOLD seconds (the race), else nothing."""
    readable, _, _ = select.select([conn], [], [], HOLD)
    return conn.recv(65536) if readable else b""


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _answer(conn: socket.socket, line: bytes) -> bytes:
    """Answer one request; returns bytes of a next request already received."""
    if line.startswith(b"GET /list"):
        cut = len(SLICES) // 2
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(SLICES), SLICES[:cut])
        )
        early = _next_request_or_hold(conn)
        conn.sendall(SLICES[cut:])
        return early
    if line.startswith(b"GET /watch"):
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
            + _chunk(b'{"type":"ERROR","object":{"code":410}}\n')
        )
        early = _next_request_or_hold(conn)
        conn.sendall(_chunk(b'{"type":"ADDED","object":{}}\n') + b"0\r\n\r\n")
        return early
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    return b""


def _serve(conn: socket.socket) -> None:
    pending = b""
    with conn:
        while True:
            request = _read_request(conn, pending)
            if request is None:
                return
            line, pending = request
            try:
                pending += _answer(conn, line)
            except OSError:
                return  # the client closed the connection: its choice


@pytest.fixture
def pool() -> Iterator[urllib3.HTTPConnectionPool]:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=_serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    connections = urllib3.HTTPConnectionPool("127.0.0.1", port, maxsize=1, retries=False)
    yield connections
    connections.close()
    listener.close()


def _next_request_is_answered(pool: urllib3.HTTPConnectionPool) -> None:
    answer = pool.request("GET", "/next", preload_content=True)
    assert (answer.status, answer.data) == (200, b"ok")


def test_a_probe_reads_its_answer_before_the_connection_is_used_again(
    pool: urllib3.HTTPConnectionPool,
) -> None:
    watch = OptionalWatch([], lambda: pool.request("GET", "/list", preload_content=False), "")
    assert watch.probe()
    _next_request_is_answered(pool)


def test_a_body_read_whole_leaves_a_clean_connection(pool: urllib3.HTTPConnectionPool) -> None:
    assert json.loads(raw.body(pool.request("GET", "/list", preload_content=False)))["items"]
    _next_request_is_answered(pool)


def test_a_watch_left_before_its_end_does_not_hand_its_rest_to_the_next_request(
    pool: urllib3.HTTPConnectionPool,
) -> None:
    lines = raw.json_lines(pool.request("GET", "/watch", preload_content=False))
    assert next(lines)["type"] == "ERROR"
    lines.close()  # what the informer's WatchExpired does to the generator
    _next_request_is_answered(pool)


def test_a_watch_read_to_its_end_gives_its_connection_back_for_reuse(
    pool: urllib3.HTTPConnectionPool,
) -> None:
    events = list(raw.json_lines(pool.request("GET", "/watch", preload_content=False)))
    assert [e["type"] for e in events] == ["ERROR", "ADDED"]
    assert pool.num_connections == 1
    _next_request_is_answered(pool)
    assert pool.num_connections == 1  # the same connection served the next request
