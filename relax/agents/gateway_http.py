"""The agent gateway's transport: an asyncio HTTP/1.1 server with keep-alive, and in-process
``httpx`` transports that reach the gateway without a socket.

Why not a thread per connection (``relax.bounded_http``, which the gateway used before): a run of
1,024 concurrent trajectories then held a server thread per kept-alive connection on top of the
trajectories' own, and the gateway arms of ``bench/gateway.py`` took 2.7x to 3.6x the built-in
environment's time per step. Here one event loop (one thread) reads, parses and answers every
connection; a connection costs a file descriptor, not a thread. The call itself
(``ProgramDriver.serve``: render, wait for the batcher, parse) blocks, so it is run on the thread of
the trajectory its key names, which otherwise only waits for its program (``ProgramDriver.dispatch``).

The hardening of ``relax.bounded_http`` holds:

- the key (``Authorization: Bearer`` or ``x-api-key``) is checked, and the ``Content-Length``
  against ``MAX_BODY_BYTES``, before a byte of the body is read (401 or 413, then the connection is
  closed with the body unread);
- headers past ``MAX_HEADER_BYTES`` get 431; a malformed request 400;
- a new connection that sends nothing for ``IDLE_TIMEOUT_S`` is closed, and so is a kept-alive one
  between requests; every read once a request has started waits at most ``READ_TIMEOUT_S``;
- at most ``max_open`` connections are open (503 past it), at most ``max_active`` requests are
  served at once (503) and ``max_per_key`` per key (429).

The in-process transports (``http_client``, ``async_http_client``) hand a request of an agent
program running in the driver's process straight to the same routes: no socket, no HTTP parsing.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import json
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import h11

from relax.agents.wire_formats import Api, Event, GatewayError, sse
from relax.bounded_http import PerKeyBound, content_length


class Reachable(Protocol):
    """What an in-process client needs of a gateway: the driver itself, or in an agent program's
    worker process the channel back to it (``relax.agents.program_processes``)."""

    base_url: str

    def in_process(self, sync: bool = True) -> Any:
        """The shared in-process ``httpx2`` client (``http_client``)."""


class Served(Reachable, Protocol):
    """What the server needs of the agent side (``relax.agents.gateway.ProgramDriver`` is the one):
    named here so that the server does not import the driver that starts it."""

    def check_key(self, key: str | None) -> None:
        """Raise ``GatewayError`` (401) unless ``key`` names a live trajectory."""

    def models(self, key: str | None) -> dict[str, Any]:
        """The body of ``GET /v1/models``."""

    def serve(self, key: str | None, api: Api, body: Any) -> dict[str, Any] | Iterator[Event]:
        """The answer to one model call (blocks while the model generates)."""

    def dispatch(self, key: str | None, work: Callable[[], Any], reply: Callable[[Any], None]) -> None:
        """Run ``work`` where the key's calls are served, and hand its result to ``reply``."""

    routes: Routes
    """The driver's routes (every transport's: the socket's, the in-process clients', the program
    workers' channels), so that they share one per-key bound."""


#: The routes the gateway answers, each with the wire format it speaks.
ROUTES: dict[str, Api] = {"/v1/chat/completions": "chat", "/v1/responses": "responses", "/v1/messages": "messages",
                          "/v1/completions": "completions", "/v1/relax/turn_reward": "turn_reward"}
#: Largest request body read: a call carries the conversation so far as text, far less than this.
MAX_BODY_BYTES = 16 * 1024 * 1024
#: Largest request line and headers (an OpenAI or Anthropic client sends well under 2 KiB).
MAX_HEADER_BYTES = 64 * 1024
#: Connections open at once, idle or not (each holds a file descriptor, no thread).
MAX_OPEN = 4096
#: Requests served at once (each a model call of a trajectory; more get 503).
MAX_ACTIVE = 256
#: Calls of one trajectory (one key) in flight at once; a trajectory's calls are served one at a time.
MAX_CALLS_PER_KEY = 4
#: A connection silent this long (new, or kept alive between requests) is closed. Longer than
#: the clients' own keep-alive expiry (httpx: 5 s), so a client never reuses a connection the
#: server is closing under it.
IDLE_TIMEOUT_S = 30.0
#: Each read once a request has started (the rest of its headers, its body) waits this long.
READ_TIMEOUT_S = 10.0
#: The size of one socket read.
_READ_BYTES = 65536


@dataclass
class Answer:
    """What a request gets: a status and a JSON body, or server-sent events (``stream``)."""

    status: int
    body: dict[str, Any] | None = None
    stream: list[Event] | None = None
    close: bool = False
    """Close the connection after the answer (the body was left unread)."""

    def head(self) -> list[tuple[bytes, bytes]]:
        if self.stream is not None:
            return [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        headers = [(b"content-type", b"application/json")]
        if self.status >= 500:  # the OpenAI client retries 5xx; a failed backend or gateway will not recover
            headers.append((b"x-should-retry", b"false"))
        return headers

    def chunks(self) -> Iterator[bytes]:
        if self.stream is not None:
            yield from (sse(event) for event in self.stream)
        else:
            yield json.dumps(self.body).encode("utf-8")


@dataclass
class Relayed(Answer):
    """An answer made elsewhere (by the driver, for a program worker's own server), sent on as it
    came: its headers and its whole body."""

    headers: list[tuple[str, str]] = field(default_factory=list)
    content: bytes = b""

    def head(self) -> list[tuple[bytes, bytes]]:
        return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in self.headers]

    def chunks(self) -> Iterator[bytes]:
        yield self.content


def base_url_of(host: str, port: int) -> str:
    """The base URL a program is given for a server listening on ``host:port`` (a wildcard address
    is reached on loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"


def key_of(headers: dict[str, str]) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header (OpenAI clients) or of ``x-api-key``
    (Anthropic clients), or None. ``headers`` has lower-case names."""
    auth = headers.get("authorization") or ""
    if auth.startswith("Bearer "):
        return auth[len("Bearer "):].strip()
    return (headers.get("x-api-key") or "").strip() or None


def no_route(method: str, path: str) -> GatewayError:
    return GatewayError(404, f"no route {method} {path}; the gateway serves POST /v1/chat/completions, "
                             "/v1/responses, /v1/messages (Anthropic), /v1/completions and GET /v1/models",
                        code="not_found")


class Admission(abc.ABC):
    """What a server does with a request: admit it before its body is read (the route, the key, the
    body's size), then answer it."""

    def admit(self, method: str, path: str, headers: dict[str, str]) -> tuple[int | None, Answer | None]:
        """Before the body: the number of body bytes to read, or the answer (the connection then
        closes, its body unread). GET needs no body."""
        api = self.api(path)
        if method == "GET":
            return 0, None
        if method != "POST":
            return None, self.refuse(no_route(method, path), api, close=True)
        try:
            self.check_key(key_of(headers))
            length, why = content_length(headers_cased(headers), MAX_BODY_BYTES)
            if length is None:
                raise (GatewayError(413, f"{why}; send a smaller request (the whole conversation so far, "
                                         "as text, fits well within it)", code="request_too_large")
                       if why and why.startswith("the body is") else
                       GatewayError(400, f"the request needs a Content-Length header ({why})"))
        except GatewayError as exc:
            return None, self.refuse(exc, api, close=True)
        return length, None

    @abc.abstractmethod
    def check_key(self, key: str | None) -> None:
        """Raise the 401 ``GatewayError`` for a key no call may be served under."""

    @abc.abstractmethod
    async def answer(self, method: str, path: str, headers: dict[str, str], raw: bytes) -> Answer:
        """The answer to a whole request, awaited on a server's event loop (which no call blocks)."""

    @staticmethod
    def api(path: str) -> Api | None:
        return ROUTES.get(path.split("?", 1)[0].rstrip("/"))

    @staticmethod
    def refuse(exc: GatewayError, api: Api | None, close: bool = False) -> Answer:
        return Answer(exc.status, exc.body(api), close=close)


class Routes(Admission):
    """The gateway's HTTP semantics, whatever carries the request (a socket, an in-process
    transport, a program worker's channel): the key and the body's size before the body, the
    per-key bound, then the route."""

    def __init__(self, driver: Served, max_per_key: int = MAX_CALLS_PER_KEY) -> None:
        self.driver = driver
        self.max_per_key = max_per_key
        self._per_key = PerKeyBound(max_per_key)

    def check_key(self, key: str | None) -> None:
        self.driver.check_key(key)

    def key_slot(self, key: str) -> contextlib.AbstractContextManager[bool]:
        """Count one request in flight under ``key`` while the block runs; False (and nothing
        counted) when ``max_per_key`` are in flight already: the answer is 429."""
        return self._per_key.slot(key)

    def handle(self, method: str, path: str, headers: dict[str, str], raw: bytes) -> Answer:
        """The answer to a whole request (blocks while the model generates: call it on the
        trajectory's thread, or on the program's own for an in-process call)."""
        api = self.api(path)
        key = key_of(headers)
        try:
            if method == "GET":
                if path.split("?", 1)[0].rstrip("/") != "/v1/models":
                    raise no_route(method, path)
                return Answer(200, self.driver.models(key))
            if api is None:
                raise no_route(method, path)
            try:
                body = json.loads(raw or b"null")
            except ValueError as exc:
                raise GatewayError(400, f"the request body is not JSON ({exc})") from exc
            served = self.driver.serve(key, api, body)
            if isinstance(served, dict):
                return Answer(200, served)
            return Answer(200, stream=list(served))  # a stream: its events are made before the first is sent
        except GatewayError as exc:
            return self.refuse(exc, api)
        except Exception as exc:  # a gateway bug: the program gets it as an error, the server goes on
            return self.refuse(GatewayError(500, f"the Relax gateway failed: {type(exc).__name__}: {exc}",
                                            kind="server_error"), api)

    def busy(self, key: str | None, api: Api | None) -> Answer:
        return Answer(429, GatewayError(429, f"{self.max_per_key} calls of this trajectory are in flight already; "
                                             "wait for one to answer", code="rate_limit_exceeded").body(api))

    async def answer(self, method: str, path: str, headers: dict[str, str], raw: bytes) -> Answer:
        """``handle`` for an event loop: the blocking part runs on the key's trajectory's thread."""
        if method == "GET":  # /v1/models: no model call, answered at once
            return self.handle(method, path, headers, raw)
        key = key_of(headers)
        with self.key_slot(key or "") as granted:
            if not granted:
                return self.busy(key, self.api(path))
            return await dispatched(self.driver, key, lambda: self.handle(method, path, headers, raw))

    def call(self, method: str, path: str, headers: dict[str, str], raw: bytes) -> Answer:
        """A whole request served on the calling thread (the sync in-process transport)."""
        length, refusal = self.admit(method, path, headers)
        if refusal is not None:
            return refusal
        if method == "GET":
            return self.handle(method, path, headers, raw)
        key = key_of(headers)
        with self.key_slot(key or "") as granted:
            if not granted:
                return self.busy(key, self.api(path))
            return self.handle(method, path, headers, raw)

    def call_dispatched(self, method: str, path: str, headers: dict[str, str], raw: bytes,
                        reply: Callable[[Answer], None]) -> None:
        """A whole request from an agent program's worker process (``relax.agents.program_processes``):
        its model call served on the trajectory's thread, its answer handed to ``reply`` there."""
        length, refusal = self.admit(method, path, headers)
        if refusal is not None or method == "GET":
            reply(refusal or self.handle(method, path, headers, raw))
            return
        key = key_of(headers) or ""
        if not self._per_key.take(key):
            reply(self.busy(key, self.api(path)))
            return

        def work() -> Answer:
            try:
                return self.handle(method, path, headers, raw)
            finally:
                self._per_key.give(key)

        self.driver.dispatch(key, work, reply)

    async def call_async(self, method: str, path: str, headers: dict[str, str], raw: bytes) -> Answer:
        """A whole request, its model call served on the trajectory's thread (the async transport)."""
        length, refusal = self.admit(method, path, headers)
        if refusal is not None:
            return refusal
        return await self.answer(method, path, headers, raw)


def _quiet_cancel(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's exception handler: a connection cancelled by ``close`` (its call still being
    served) is no error on the run's console; anything else is reported as asyncio would."""
    if isinstance(context.get("exception"), asyncio.CancelledError):
        return
    loop.default_exception_handler(context)


async def dispatched(driver: Served, key: str | None, work: Callable[[], Answer]) -> Answer:
    """Run ``work`` where the driver serves the key's calls (``ProgramDriver.dispatch``: the
    trajectory's thread) and await its answer on the running loop, which no call blocks."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Answer] = loop.create_future()

    def done(answer: Answer) -> None:
        if not future.done():
            future.set_result(answer)

    def reply(answer: Answer) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed (the gateway is stopping): nobody waits
            loop.call_soon_threadsafe(done, answer)

    driver.dispatch(key, work, reply)
    return await future


class _Cased:
    """Read-only case-insensitive view of lower-cased headers (``content_length`` reads ``Content-Length``)."""

    def __init__(self, headers: dict[str, str]) -> None:
        self._headers = headers

    def get(self, name: str, default: Any = None) -> Any:
        return self._headers.get(name.lower(), default)


def headers_cased(headers: dict[str, str]) -> _Cased:
    return _Cased(headers)


class GatewayServer:
    """The asyncio HTTP/1.1 server of one ``ProgramDriver`` (or of one of its program worker
    processes, whose routes forward each call to it), on its own event loop thread."""

    def __init__(self, routes: Admission, host: str, port: int, max_active: int = MAX_ACTIVE) -> None:
        self.routes = routes
        self.max_active, self.max_open = max_active, MAX_OPEN
        self.idle_timeout_s, self.read_timeout_s = IDLE_TIMEOUT_S, READ_TIMEOUT_S
        self.open = 0
        """Connections open now."""
        self.accepted = 0
        """Connections accepted since the server started."""
        self._writers: set[asyncio.StreamWriter] = set()
        self.active = 0
        """Requests being served now (read past their headers, not yet answered)."""
        self.loop = asyncio.new_event_loop()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._socket.bind((host, port))
            self._socket.listen(4096)
            self._socket.setblocking(False)
        except OSError:
            self._socket.close()
            self.loop.close()
            raise
        self.server_address = self._socket.getsockname()
        self._server: asyncio.AbstractServer | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relax-agent-gateway", daemon=True)
        self._thread.start()
        self._started.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.set_exception_handler(_quiet_cancel)

        async def start() -> None:
            self._server = await asyncio.start_server(self._connection, sock=self._socket, limit=_READ_BYTES)

        self.loop.run_until_complete(start())
        self._started.set()
        self.loop.run_forever()

    def close(self) -> None:
        """Stop listening, close every connection and the loop. Idle connections are closed under
        their clients; one still waiting for its call's answer is cancelled."""
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                writer.close()  # its handler reads the end of the stream and returns
            connections = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            if connections:
                _, pending = await asyncio.wait(connections, timeout=1.0)
                for task in pending:
                    task.cancel()
                await asyncio.wait(connections, timeout=1.0)

        if self.loop.is_running():
            with contextlib.suppress(concurrent.futures.TimeoutError):
                asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=10)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()
        self._socket.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        self.accepted += 1
        self._writers.add(writer)
        try:
            if self.open > self.max_open:
                await self._refuse(writer, "too many open connections; retry later")
                return
            await self._serve(reader, writer)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, h11.ProtocolError):
            pass  # a client that hangs up or falls silent is its own business
        finally:
            self.open -= 1
            self._writers.discard(writer)
            writer.close()

    async def _refuse(self, writer: asyncio.StreamWriter, message: str) -> None:
        body = json.dumps(GatewayError(503, message, kind="server_error", code="server_busy").body()).encode()
        writer.write((f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: "
                      f"{len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode() + body)
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            await asyncio.wait_for(writer.drain(), self.read_timeout_s)

    async def _next(self, conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
        """The next h11 event, reading from the socket as it needs to: a connection silent between
        requests waits ``idle_timeout_s``, each read once a request has begun ``read_timeout_s``."""
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            begun = conn.their_state is not h11.IDLE or bool(conn.trailing_data[0])
            data = await asyncio.wait_for(reader.read(_READ_BYTES),
                                          self.read_timeout_s if begun else self.idle_timeout_s)
            conn.receive_data(data)  # b"" at the end: h11 then says ConnectionClosed (or raises mid-request)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        while True:
            try:
                event = await self._next(conn, reader)
            except h11.RemoteProtocolError as exc:
                if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    status = exc.error_status_hint
                    why = (f"the request line and headers are larger than the {MAX_HEADER_BYTES} bytes this server "
                           "reads" if status == 431 else f"malformed request ({exc})")
                    await self._send(conn, writer, Answer(status, GatewayError(status, why).body(), close=True))
                return
            if not isinstance(event, h11.Request):
                return  # the client closed the connection
            if len(event.target) + sum(len(name) + len(value) + 4 for name, value in event.headers) > MAX_HEADER_BYTES:
                # (h11 bounds headers still arriving; ones that came whole in one read are measured here)
                await self._send(conn, writer, Answer(431, GatewayError(
                    431, f"the request line and headers are larger than the {MAX_HEADER_BYTES} bytes this server "
                         "reads").body(), close=True))
                return
            method = event.method.decode("ascii", "replace")
            path = event.target.decode("ascii", "replace")
            headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in event.headers}
            length, refusal = self.routes.admit(method, path, headers)
            if refusal is not None or length is None:
                await self._send(conn, writer, refusal or Answer(400, GatewayError(400, "malformed request").body(),
                                                                close=True))
                return
            if self.active >= self.max_active:
                await self._send(conn, writer, Answer(503, GatewayError(
                    503, f"the gateway is serving {self.max_active} requests already; retry later",
                    kind="server_error", code="server_busy").body(), close=True))
                return
            self.active += 1
            try:
                raw = bytearray()
                while True:
                    part = await self._next(conn, reader)
                    if isinstance(part, h11.Data):
                        raw += part.data
                        if len(raw) > MAX_BODY_BYTES:
                            return
                    elif isinstance(part, h11.EndOfMessage):
                        break
                    else:
                        return
                answer = await self.routes.answer(method, path, headers, bytes(raw))
            finally:
                self.active -= 1
            await self._send(conn, writer, answer)
            if answer.close or conn.our_state is h11.MUST_CLOSE:
                return
            conn.start_next_cycle()

    async def _send(self, conn: h11.Connection, writer: asyncio.StreamWriter, answer: Answer) -> None:
        headers = answer.head()
        if answer.close:
            headers.append((b"connection", b"close"))
        chunks = list(answer.chunks())
        if answer.stream is None:
            headers.append((b"content-length", str(len(chunks[0])).encode()))
        else:
            headers.append((b"transfer-encoding", b"chunked"))
        out = [conn.send(h11.Response(status_code=answer.status, headers=headers))]
        out += [conn.send(h11.Data(data=chunk)) for chunk in chunks if chunk]
        out.append(conn.send(h11.EndOfMessage()))
        writer.write(b"".join(part for part in out if part))
        await asyncio.wait_for(writer.drain(), self.read_timeout_s)


# -- in process ------------------------------------------------------------------------------------

_LIVE: dict[str, Reachable] = {}
"""The drivers serving in this process, by base URL (``http_client`` finds its gateway here)."""
_LIVE_LOCK = threading.Lock()


def register(base_url: str, driver: Reachable) -> None:
    with _LIVE_LOCK:
        _LIVE[base_url] = driver


def unregister(base_url: str, driver: Reachable) -> None:
    with _LIVE_LOCK:
        if _LIVE.get(base_url) is driver:
            del _LIVE[base_url]


def _driver(base_url: str) -> Reachable:
    with _LIVE_LOCK:
        driver = _LIVE.get(str(base_url).rstrip("/"))
    if driver is None:
        raise ValueError(f"no Relax agent gateway serves {base_url!r} in this process; pass the base_url the "
                         "agent program was called with, from within the program (the in-process client "
                         "reaches only the gateway of the run that called it)")
    return driver


def http_client(base_url: str) -> Any:
    """The shared ``httpx2.Client`` that reaches the gateway at ``base_url`` without a socket, for
    a plain (``def``) agent program: ``openai.OpenAI(base_url=base_url, api_key=api_key,
    http_client=http_client(base_url))``. One per gateway, so build it once per run, not per
    trajectory (reuse it with ``with_options(api_key=...)``)."""
    return _driver(base_url).in_process(sync=True)


def async_http_client(base_url: str) -> Any:
    """The shared ``httpx2.AsyncClient`` that reaches the gateway at ``base_url`` without a
    socket, for an ``async def`` agent program (all of them run on the gateway's one event loop)."""
    return _driver(base_url).in_process(sync=False)


def request_parts(request: Any) -> tuple[str, str, dict[str, str]]:
    """An ``httpx2`` request's method, path and lower-cased headers, as the routes take them."""
    headers = {name.lower(): value for name, value in request.headers.items()}
    return request.method, request.url.raw_path.decode("ascii", "replace"), headers


def in_process_client(driver: Served, sync: bool) -> Any:
    """A new ``httpx2`` client whose transport is the driver's routes (``http_client``)."""
    import httpx2

    routes = driver.routes

    def response_of(answer: Answer, request: Any) -> Any:
        headers = [(name.decode(), value.decode()) for name, value in answer.head()]
        return httpx2.Response(answer.status, headers=headers, content=b"".join(answer.chunks()), request=request)

    class Transport(httpx2.BaseTransport):
        """Serves each request on the calling (program's) thread."""

        def handle_request(self, request: Any) -> Any:
            method, path, headers = request_parts(request)
            return response_of(routes.call(method, path, headers, request.read()), request)

    class AsyncTransport(httpx2.AsyncBaseTransport):
        """Serves each request's model call on the trajectory's thread; the loop never blocks."""

        async def handle_async_request(self, request: Any) -> Any:
            method, path, headers = request_parts(request)
            raw = await request.aread()
            return response_of(await routes.call_async(method, path, headers, raw), request)

    base = driver.base_url
    if sync:
        return httpx2.Client(transport=Transport(), base_url=base, timeout=None)
    return httpx2.AsyncClient(transport=AsyncTransport(), base_url=base, timeout=None)
