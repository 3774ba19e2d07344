"""One unary gRPC call over a unix socket: HTTP/2 framing by `h2`, the rest by hand.

The agent asks the kubelet one question per cycle, and its memory target leaves no room for the
grpcio runtime (its import alone costs several times this client; benchmarks/README.md). A gRPC
unary call is one HTTP/2 stream: request headers, one length-prefixed message, then the
answer's headers, one message and trailers carrying `grpc-status`. Everything else (streams,
compression, retries, keep-alives) this call does not need and does not offer.
"""

from __future__ import annotations

import contextlib
import socket
import time
import urllib.parse
from pathlib import Path

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from gpuusage import __version__
from gpuusage.errors import GpuusageError

MAX_ANSWER = 16 * 1024 * 1024
"""The kubelet's own limit on a PodResources answer; a longer one is refused, not buffered."""
WINDOW = MAX_ANSWER
"""Flow-control window offered, so the whole answer arrives without waiting on our updates."""

STATUS_NAMES = {
    1: "Cancelled",
    2: "Unknown",
    3: "InvalidArgument",
    4: "DeadlineExceeded",
    5: "NotFound",
    6: "AlreadyExists",
    7: "PermissionDenied",
    8: "ResourceExhausted",
    9: "FailedPrecondition",
    10: "Aborted",
    11: "OutOfRange",
    12: "Unimplemented",
    13: "Internal",
    14: "Unavailable",
    15: "DataLoss",
    16: "Unauthenticated",
}


class CallError(GpuusageError):
    """The call did not produce an answer; the message says where it failed."""


class DeadlineExceeded(CallError):
    """The server says the call's deadline (the grpc-timeout we sent) passed."""


class Reset(CallError):
    """The server reset the stream (RST_STREAM) with this HTTP/2 error code."""

    def __init__(self, code: int | None) -> None:
        super().__init__(f"the server reset the stream (HTTP/2 error {code})")
        self.code = code


class _Call:
    """The state of one stream while its events arrive."""

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.trailers: dict[str, str] = {}
        self.body = bytearray()
        self.ended = False

    def take(self, event: h2.events.Event, conn: h2.connection.H2Connection) -> None:
        if isinstance(event, h2.events.ResponseReceived):
            self.headers = _decoded(event.headers)
        elif isinstance(event, h2.events.TrailersReceived):
            self.trailers = _decoded(event.headers)
        elif isinstance(event, h2.events.DataReceived):
            self.body += event.data
            if len(self.body) > MAX_ANSWER + 5:
                raise CallError(f"the answer is larger than {MAX_ANSWER} bytes")
            conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            self.ended = True
        elif isinstance(event, h2.events.StreamReset):
            raise Reset(event.error_code)
        elif isinstance(event, h2.events.ConnectionTerminated):
            raise CallError(f"the server closed the connection (HTTP/2 error {event.error_code})")


def _decoded(headers: list[tuple[bytes, bytes]] | None) -> dict[str, str]:
    return {
        bytes(k).decode("ascii", "replace").lower(): bytes(v).decode("utf-8", "replace")
        for k, v in headers or []
    }


def _status(call: _Call) -> None:
    """Raise for any answer that is not a successful gRPC response."""
    http = call.headers.get(":status")
    if http != "200":
        raise CallError(f"the server answered HTTP {http or 'without a status'}, not gRPC")
    said = call.trailers or call.headers  # a "trailers-only" answer puts them in the headers
    code = said.get("grpc-status")
    if code is None:
        raise CallError("the answer ended without a grpc-status")
    if code != "0":
        name = STATUS_NAMES.get(int(code) if code.isdigit() else -1, f"status {code}")
        message = urllib.parse.unquote(said.get("grpc-message", ""))
        error = DeadlineExceeded if code == "4" else CallError
        raise error(f"{name}: {message}" if message else name)


def _message(body: bytes) -> bytes:
    """The one message of a unary answer, from gRPC's length-prefixed framing."""
    if len(body) < 5:
        raise CallError("the answer holds no message")
    if body[0] != 0:
        raise CallError("the answer is compressed, which this call did not offer")
    size = int.from_bytes(body[1:5], "big")
    if len(body) != 5 + size:
        raise CallError(f"the answer's framing says {size} bytes, {len(body) - 5} arrived")
    return bytes(body[5:])


def unary(path: Path, method: str, request: bytes, timeout: float) -> bytes:
    """Call `method` (e.g. /v1.PodResourcesLister/List) on the gRPC server at unix socket
    `path`; the answer's message bytes. Raises CallError, or OSError from the socket."""
    deadline = time.monotonic() + timeout
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding=None)
    )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        conn.initiate_connection()
        conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW})
        conn.increment_flow_control_window(WINDOW)
        stream = conn.get_next_available_stream_id()
        conn.send_headers(
            stream,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", method),
                (":authority", "localhost"),
                ("te", "trailers"),
                ("content-type", "application/grpc"),
                ("user-agent", f"gpuusage-agent/{__version__}"),
                ("grpc-timeout", f"{max(1, int(timeout * 1000))}m"),
            ],
        )
        conn.send_data(stream, b"\0" + len(request).to_bytes(4, "big") + request, end_stream=True)
        sock.sendall(conn.data_to_send())
        call = _Call()
        try:
            while not call.ended:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CallError(f"no answer within {timeout:g}s")
                sock.settimeout(left)
                try:
                    data = sock.recv(65536)
                except TimeoutError as exc:
                    raise CallError(f"no answer within {timeout:g}s") from exc
                if not data:
                    raise CallError("the server closed the connection before answering")
                try:
                    for event in conn.receive_data(data):
                        call.take(event, conn)
                except Reset as exc:
                    # A gRPC server cancels the call when the grpc-timeout we sent passes; its
                    # clock started after ours, so such a reset arrives after our deadline.
                    if exc.code == h2.errors.ErrorCodes.CANCEL and time.monotonic() >= deadline:
                        raise CallError(f"no answer within {timeout:g}s") from exc
                    raise
                sock.sendall(conn.data_to_send())
        except h2.exceptions.ProtocolError as exc:
            raise CallError(f"HTTP/2 protocol error: {exc} (is it a gRPC server?)") from exc
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise CallError(
                "the server closed the connection before answering (is it a gRPC server?)"
            ) from exc
        conn.close_connection()
        with contextlib.suppress(OSError):  # the answer is complete; a server gone loses nothing
            sock.sendall(conn.data_to_send())
    try:
        _status(call)
    except DeadlineExceeded as exc:  # the server's clock reached our deadline before ours did
        raise CallError(f"no answer within {timeout:g}s ({exc})") from exc
    return _message(bytes(call.body))
