"""An HTTP server whose threads and memory a local client cannot run away with: the base of the
run's control endpoint (``relax.runtime.driver.control``). The agent gateway, which must serve
thousands of concurrent trajectories, has an asyncio server instead (``relax.agents.gateway_http``)
with the same bounds, and uses ``content_length`` from here.

Loopback is reachable by every local user and by the pages of the user's browser, and the
standard library's ``ThreadingHTTPServer`` starts one thread per connection, waits on it without
a time limit and lets the handler read whatever body it is promised. So here:

- a connection takes no thread until its first bytes arrive: one "porter" thread watches the
  connections that have not spoken yet (at most ``max_waiting``; one silent for ``idle_timeout_s``
  is closed), so a thousand idle connections cost a thousand file descriptors, not a thousand
  threads;
- at most ``max_active`` connections are served at once; past it a connection is answered 503 by
  the porter and closed, rather than given another thread;
- every read after the first bytes has ``read_timeout_s`` (a half-sent request frees its thread
  then, and so does a kept-alive connection left idle);
- the handlers (not this module) check the key in the ``Authorization`` header before they read a
  body, refuse a body larger than their cap with 413 without reading it, and count the requests in
  flight per key (``key_slot``: 429 past ``max_per_key``).

Only the standard library: ``relax scale`` imports this without ray or torch.
"""

from __future__ import annotations

import contextlib
import json
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from typing import Any

#: Connections served at once (each holds a thread while it is read, handled or kept alive).
MAX_ACTIVE = 64
#: Connections accepted that have not sent their first bytes yet (each holds a file descriptor).
MAX_WAITING = 4096
#: A connection that sends nothing this long after it is opened is closed.
IDLE_TIMEOUT_S = 30.0
#: Each read of a request once it started (headers, body, the next request on a kept-alive
#: connection) may wait this long.
READ_TIMEOUT_S = 10.0
#: Requests in flight under one key.
MAX_PER_KEY = 8
#: What a client's broken or silent connection raises while the server reads or answers.
HANG_UP = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)


class PerKeyBound:
    """Requests in flight per API key, at most ``limit`` each: one program cannot take every
    handler thread (or every model slot) of a server that many programs share."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._taken: dict[str, int] = {}
        self._guard = threading.Lock()

    def take(self, key: str) -> bool:
        """Count one request under ``key``; False (and nothing counted) when ``limit`` are in flight."""
        with self._guard:
            taken = self._taken.get(key, 0)
            if taken >= self.limit:
                return False
            self._taken[key] = taken + 1
            return True

    def give(self, key: str) -> None:
        """Uncount a request ``take`` counted."""
        with self._guard:
            left = self._taken[key] - 1
            if left:
                self._taken[key] = left
            else:
                del self._taken[key]

    @contextlib.contextmanager
    def slot(self, key: str) -> Iterator[bool]:
        """Count one request under ``key`` while the block runs; yields False (and counts nothing)
        when ``limit`` are in flight already."""
        granted = self.take(key)
        try:
            yield granted
        finally:
            if granted:
                self.give(key)


class BoundedHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with a porter for silent connections and a bound on the connections
    served (see the module docstring). Subclasses may set the class attributes below and override
    ``refusal`` for the body of the porter's 503."""

    daemon_threads = True
    #: Connections the kernel queues before they are accepted (the standard library's 5 refuses
    #: most of a batch of clients connecting at once).
    request_queue_size = 1024
    max_active = MAX_ACTIVE
    max_waiting = MAX_WAITING
    idle_timeout_s = IDLE_TIMEOUT_S
    read_timeout_s = READ_TIMEOUT_S
    max_per_key = MAX_PER_KEY

    def __init__(self, server_address: Any, handler: Any, bind_and_activate: bool = True) -> None:
        super().__init__(server_address, handler, bind_and_activate)
        self._guard = threading.Lock()
        self._active = 0
        self._per_key = PerKeyBound(self.max_per_key)
        self._waiting: dict[socket.socket, tuple[Any, float]] = {}
        self._arrivals: list[tuple[socket.socket, Any]] = []
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._closing = False
        self._porter = threading.Thread(target=self._watch, name="http-porter", daemon=True)
        self._porter.start()

    # -- what a refusal says ------------------------------------------------------------------------

    def refusal(self, status: int, message: str) -> dict[str, Any]:
        """The JSON body of a refusal the server itself sends (503: too many connections)."""
        return {"error": message}

    def _refuse(self, sock: socket.socket, status: int, reason: str, message: str) -> None:
        """Answer without a thread and close: a short non-blocking write, dropped if it does not fit."""
        body = json.dumps(self.refusal(status, message)).encode()
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "Retry-After: 1\r\nConnection: close\r\n\r\n").encode()
        try:
            sock.setblocking(False)
            sock.send(head + body)
        except OSError:
            pass
        self.shutdown_request(sock)

    # -- accepting ---------------------------------------------------------------------------------

    def process_request(self, request: Any, client_address: Any) -> None:
        """Called on the serving thread for each accepted connection: hand it to the porter."""
        with self._guard:
            full = len(self._waiting) + len(self._arrivals) >= self.max_waiting or self._closing
            if not full:
                self._arrivals.append((request, client_address))
        if full:
            self._refuse(request, 503, "Service Unavailable", "too many open connections; retry later")
            return
        try:
            self._wake_w.send(b"x")
        except OSError:  # the wake-up pipe is full: the porter is awake already
            pass

    def _watch(self) -> None:
        """The porter: waits for each silent connection's first bytes, then serves it on a thread."""
        while True:
            timeout = self.idle_timeout_s
            if self._waiting:
                oldest = min(at for _, at in self._waiting.values())
                timeout = max(0.0, oldest + self.idle_timeout_s - time.monotonic())
            events = self._selector.select(timeout=min(timeout, 1.0))
            if self._closing:
                return
            for key, _ in events:
                sock = key.fileobj
                if sock is self._wake_r:
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except OSError:
                        pass
                    continue
                address, _ = self._waiting.pop(sock)  # type: ignore[call-overload]
                self._selector.unregister(sock)
                self._dispatch(sock, address)  # type: ignore[arg-type]
            with self._guard:
                arrivals, self._arrivals = self._arrivals, []
            now = time.monotonic()
            for sock, address in arrivals:
                self._waiting[sock] = (address, now)
                self._selector.register(sock, selectors.EVENT_READ)
            for sock, (_, at) in list(self._waiting.items()):
                if now - at >= self.idle_timeout_s:  # said nothing: closed without an answer
                    del self._waiting[sock]
                    self._selector.unregister(sock)
                    self.shutdown_request(sock)

    def _dispatch(self, sock: socket.socket, address: Any) -> None:
        with self._guard:
            busy = self._active >= self.max_active
            if not busy:
                self._active += 1
        if busy:
            self._refuse(sock, 503, "Service Unavailable", f"the server is serving {self.max_active} connections "
                         "already; retry later")
            return
        sock.setblocking(True)
        sock.settimeout(self.read_timeout_s)
        thread = threading.Thread(target=self._serve, args=(sock, address), name="http-handler", daemon=True)
        thread.start()

    def _serve(self, sock: socket.socket, address: Any) -> None:
        try:
            self.finish_request(sock, address)
        except Exception:
            self.handle_error(sock, address)
        finally:
            self.shutdown_request(sock)
            with self._guard:
                self._active -= 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up or falls silent mid-request is its own business: no traceback on
        the run's console. Anything else is the handler's bug and still reported."""
        import sys

        if isinstance(sys.exc_info()[1], HANG_UP):
            return
        super().handle_error(request, client_address)

    # -- per key -----------------------------------------------------------------------------------

    def key_slot(self, key: str) -> contextlib.AbstractContextManager[bool]:
        """Count one request in flight under ``key`` while the block runs; yields False (and counts
        nothing) when ``max_per_key`` are in flight already: the handler answers 429."""
        return self._per_key.slot(key)

    @property
    def active(self) -> int:
        """Connections being served now (each on its own thread)."""
        return self._active

    # -- closing -----------------------------------------------------------------------------------

    def server_close(self) -> None:
        """Close the listening socket, the porter and every connection still waiting."""
        super().server_close()
        with self._guard:
            self._closing = True
            arrivals, self._arrivals = self._arrivals, []
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._porter.join(timeout=5.0)
        for sock in [*self._waiting, *(s for s, _ in arrivals)]:
            self.shutdown_request(sock)
        self._waiting.clear()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()


def content_length(headers: Any, limit: int) -> tuple[int | None, str | None]:
    """The request's ``Content-Length`` if it is a whole number within ``limit``; else None and
    why (too large: the handler answers 413; missing or malformed: 400/411). Read before the body."""
    given = (headers.get("Content-Length") or "").strip()
    if not given:
        return None, "missing"
    if not given.isdigit():
        return None, f"Content-Length {given[:20]!r} is not a whole number"
    length = int(given)
    if length > limit:
        return None, f"the body is {length} bytes, more than the {limit} this server reads"
    return length, None
