"""A TCP proxy on loopback between a client and the apiserver, for what the network does to
connections: it counts the connections it accepts, can cut them all (as a server closing idle
connections does), and can stall them (stop forwarding without closing: a half-open
connection, as a dead NAT entry or a lost peer leaves one)."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Iterator


class TcpProxy:
    """Forwards 127.0.0.1:port to target (host, port) in both directions."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.accepted = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._stalled = threading.Event()
        self._stalled_pairs: set[int] = set()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self.accepted += 1
                self._pairs.append((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        try:
            while not self._closed.is_set():
                ready, _, _ = select.select(list(peers), [], [], 0.2)
                if self._stalled.is_set() or id(a) in self._stalled_pairs:
                    time.sleep(0.05)
                    continue  # read nothing, forward nothing, close nothing
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    peers[sock].sendall(data)
        except (OSError, ValueError):  # closed meanwhile (cut, close): select refuses fd -1
            return
        finally:
            for sock in (a, b):
                with contextlib.suppress(OSError):
                    sock.close()

    def cut(self) -> None:
        """Close every open connection, both sides (new ones are still accepted)."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                    sock.close()

    def stall(self, stalled: bool = True) -> None:
        """Stop (or resume) forwarding on every connection without closing any."""
        if stalled:
            self._stalled.set()
        else:
            self._stalled.clear()

    def stall_existing(self) -> int:
        """Stop forwarding on the connections open now, without closing them (what a peer
        that vanished leaves: a half-open connection); new connections work. How many."""
        with self._lock:
            self._stalled_pairs |= {id(client) for client, _ in self._pairs}
            return len(self._pairs)

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        self.cut()


@contextlib.contextmanager
def tcp_proxy(target: tuple[str, int]) -> Iterator[TcpProxy]:
    proxy = TcpProxy(target)
    try:
        yield proxy
    finally:
        proxy.close()
