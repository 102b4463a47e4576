"""A TCP proxy between the ranks' TCPStore clients and the store's server, with faults.

The store's server listens on its own port; each rank connects to a port of the proxy
of its own (``proxy.ports[rank]``), so that the proxy knows whose connection is whose.
Every chunk read from either side is forwarded after :attr:`StoreProxy.latency_s`
(chunks keep their order; a request and its answer each take the latency, so a round
trip takes twice it), and on demand the proxy stops forwarding (:meth:`StoreProxy.hold`,
a store that hangs) or closes connections (:meth:`StoreProxy.drop`, a dropped
connection: the client reads the end of its stream).

The proxy forwards bytes and knows nothing of the store's protocol, so it serves
whatever client torch builds (its own sockets, or libuv's).

Example::

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with StoreProxy(server.port, ranks=2) as proxy:
        ...  # rank r: TCPStore("127.0.0.1", proxy.ports[r], is_master=False)
        proxy.latency_s = 0.5
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from types import TracebackType

__all__ = ["StoreProxy"]

logger = logging.getLogger(__name__)

_CHUNK = 65536


class _Pump:
    """One direction of one connection: reads chunks, forwards each once it is due."""

    def __init__(self, proxy: StoreProxy, source: socket.socket, sink: socket.socket) -> None:
        self.proxy = proxy
        self.source = source
        self.sink = sink
        self.chunks: collections.deque[tuple[float, bytes]] = collections.deque()
        self.ready = threading.Condition()
        self.ended = False

    def start(self, name: str) -> None:
        for target, part in ((self._read, "read"), (self._write, "write")):
            threading.Thread(target=target, name=f"{name}-{part}", daemon=True).start()

    def _read(self) -> None:
        try:
            while chunk := self.source.recv(_CHUNK):
                with self.ready:
                    self.chunks.append((time.monotonic() + self.proxy.latency_s, chunk))
                    self.ready.notify()
        except OSError:
            pass
        with self.ready:
            self.ended = True
            self.ready.notify()

    def _write(self) -> None:
        try:
            while True:
                with self.ready:
                    while not self.chunks and not self.ended:
                        self.ready.wait()
                    if not self.chunks:
                        break
                    due, chunk = self.chunks[0]
                wait_s = due - time.monotonic()
                if wait_s > 0:
                    time.sleep(wait_s)
                self.proxy.flowing.wait()
                with self.ready:
                    self.chunks.popleft()
                self.sink.sendall(chunk)
        except OSError:
            pass
        _close(self.sink)
        _close(self.source)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class StoreProxy:
    """Forwards each rank's store connections to the server at ``server_port``.

    Args:
        server_port: The port the store's server listens on.
        ranks: Listening ports to open, one per rank (:attr:`ports`).
        host: The address of the server and of the proxy's ports.

    Attributes:
        ports: The port rank ``r`` connects to is ``ports[r]``.
        latency_s: Added to every chunk in either direction (seconds); may change
            at any time (chunks already read keep theirs).
        accepted: Connections accepted so far, per rank.
    """

    def __init__(self, server_port: int, ranks: int, host: str = "127.0.0.1") -> None:
        self.server = (host, server_port)
        self.latency_s = 0.0
        self.flowing = threading.Event()
        self.flowing.set()
        self._lock = threading.Lock()
        self._connections: dict[int, list[tuple[socket.socket, socket.socket]]] = {
            rank: [] for rank in range(ranks)
        }
        self.accepted = [0] * ranks
        self._listeners: list[socket.socket] = []
        self.ports: list[int] = []
        self._closed = False
        for rank in range(ranks):
            listener = socket.create_server((host, 0))
            self._listeners.append(listener)
            self.ports.append(listener.getsockname()[1])
            threading.Thread(
                target=self._accept, args=(rank, listener), name=f"proxy-r{rank}", daemon=True
            ).start()

    def _accept(self, rank: int, listener: socket.socket) -> None:
        while not self._closed:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.server)
            except OSError as exc:
                logger.warning("store proxy: cannot reach the server: %s", exc)
                _close(client)
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                index = self.accepted[rank]
                self.accepted[rank] += 1
                self._connections[rank].append((client, upstream))
            name = f"proxy-r{rank}c{index}"
            _Pump(self, client, upstream).start(f"{name}-up")
            _Pump(self, upstream, client).start(f"{name}-down")

    def hold(self) -> None:
        """Stops forwarding in both directions (a store that hangs): chunks wait."""
        self.flowing.clear()

    def release(self) -> None:
        """Forwards again, the chunks that waited first."""
        self.flowing.set()

    def drop(self, rank: int | None = None, first: int = 0) -> int:
        """Closes connections: ``rank``'s (every rank's if ``None``) from its ``first``-th on.

        ``first=1`` spares each rank's first connection (the process group's own client).

        Returns:
            How many connections were closed.
        """
        closed = 0
        with self._lock:
            for r, connections in self._connections.items():
                if rank is not None and r != rank:
                    continue
                for client, upstream in connections[first:]:
                    if client.fileno() == -1 and upstream.fileno() == -1:
                        continue
                    _close(client)
                    _close(upstream)
                    closed += 1
        return closed

    def close(self) -> None:
        """Stops listening and closes every connection; safe to call twice."""
        self._closed = True
        self.release()
        for listener in self._listeners:
            _close(listener)
        self.drop()

    def __enter__(self) -> StoreProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
