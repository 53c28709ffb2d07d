"""Agent programs run in worker processes (``roles.rollout.agent.gateway.processes``).

Why: in the driver's process every program shares one interpreter lock with the gateway and the
rollout backend's own Python. An agent framework spends real CPU a call (the ``openai`` client
about 1 ms to build a request and parse its reply), so a thousand programs there make the rollout
wait for them: on the 2-core box the in-process arms of ``bench/gateway.py`` took 1.6x (async) to
2x (sync) the built-in environment's time a unit with the tiny model, while the gateway's own
share stayed near 1.1x. With ``processes: N`` the programs run in N worker processes, each with its
own interpreter, and the driver's process keeps only the gateway and the model.

A program in a worker is given the worker's own base URL, and needs no change:

- a client of its own talks HTTP to the worker's server (``GatewayServer`` with the ``_Relaying``
  routes), which parses it in the worker's interpreter and relays each request over the worker's
  channel to the driver: the driver's process never parses a worker program's HTTP;
- ``relax.agents.gateway_http.http_client(base_url)`` / ``async_http_client`` give a client whose
  transport puts the request on the channel directly: no socket, no HTTP on either side.

Either way the driver answers it with its routes (``Routes.call_dispatched``: the key checked, the
per-key bound, the model call served on the trajectory's thread) and sends the answer back.

The channel is a socket pair carrying pickled tuples (both ends are this package's own code):

- driver to worker: ``("run", id, task, key)``, ``("cancel", id)``, ``("answer", call, status,
  headers, body)``, ``("stop",)``;
- worker to driver: ``("ready",)`` or ``("broken", why)`` once the program is imported and the
  worker's server listens, ``("call",
  call, method, path, headers, body)``, ``("done", id, outcome)``.

A program's outcome crosses as plain values (``Outcome``): its checked reward, or its exception's
type name, message and error code. A worker that dies (a crash, ``os._exit`` in a program) fails
the trajectories it was running with ``program_process_exited`` and is started again for the next.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from relax.agents.gateway_http import (
    Admission,
    Answer,
    GatewayServer,
    Relayed,
    Routes,
    base_url_of,
    register,
    request_parts,
)
from relax.agents.programs import Outcome, ProgramError, checked_reward, load_program, raised

#: Seconds a new worker may take to import the program before the run fails with that.
START_TIMEOUT_S = 120.0
#: Seconds a worker is given to exit after ``stop`` before it is killed.
STOP_TIMEOUT_S = 5.0


class Channel:
    """One end of a worker's socket pair: ``send`` from any thread, and a reader thread that hands
    each message to ``on_message`` until the other end closes (then ``on_closed``)."""

    def __init__(self, connection: Connection, on_message: Callable[[tuple], None],
                 on_closed: Callable[[], None], name: str) -> None:
        self._connection = connection
        self._send_lock = threading.Lock()
        self._on_message, self._on_closed = on_message, on_closed
        self._reader = threading.Thread(target=self._read, name=name, daemon=True)

    def start(self) -> None:
        self._reader.start()

    def send(self, message: tuple) -> bool:
        """Send ``message``; False when the other end has gone (the reader reports it)."""
        return self.send_pickled(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def send_pickled(self, data: bytes) -> bool:
        """Send a message already pickled (``send``)."""
        try:
            with self._send_lock:
                self._connection.send_bytes(data)
        except (OSError, ValueError):
            return False
        return True

    def _read(self) -> None:
        try:
            while True:
                try:
                    data = self._connection.recv_bytes()
                except (EOFError, OSError):
                    return
                self._on_message(pickle.loads(data))
        finally:
            self._on_closed()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._connection.close()


# -- the driver's side -------------------------------------------------------------------------------


class _Worker:
    """One worker process, its channel, and the runs it has not finished."""

    def __init__(self, index: int, ref: str, on_call: Callable[[_Worker, tuple], None], host: str,
                 max_active: int) -> None:
        self.index = index
        self.runs: dict[int, Callable[[Outcome], None]] = {}
        self.lock = threading.Lock()
        self.alive = True
        self._ready = threading.Event()
        self._broken: str | None = None
        self._on_call = on_call
        ours, theirs = socket.socketpair()
        with ours, theirs:
            mine, child = os.dup(ours.fileno()), os.dup(theirs.fileno())
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", "from relax.agents.program_processes import main; main()", str(child), ref,
                 json.dumps(sys.path), host, str(max_active)],
                pass_fds=(child,), stdin=subprocess.DEVNULL)
        finally:
            os.close(child)
        self.channel = Channel(Connection(mine), self._message, self._closed,
                               name=f"relax-agent-program-process-{index}")
        self.channel.start()

    def wait_ready(self, ref: str) -> None:
        if not self._ready.wait(START_TIMEOUT_S):
            self.stop()
            raise ProgramError(f"roles.rollout.agent.gateway.program={ref!r}: its worker process did not start "
                               f"within {START_TIMEOUT_S:g} s")
        if self._broken is not None:
            self.stop()
            raise ProgramError(self._broken)

    def _message(self, message: tuple) -> None:
        kind = message[0]
        if kind == "call":
            self._on_call(self, message)
        elif kind == "done":
            with self.lock:
                done = self.runs.pop(message[1], None)
            if done is not None:
                done(message[2])
        elif kind == "ready":
            self._ready.set()
        elif kind == "broken":
            self._broken = message[1]
            self._ready.set()

    def _closed(self) -> None:
        """The worker is gone: every run it had fails (nothing waits for an answer that cannot come)."""
        code = self.process.wait()
        with self.lock:
            self.alive = False
            runs, self.runs = self.runs, {}
        if self._broken is None and not self._ready.is_set():
            self._broken = f"the agent program's worker process exited with code {code} before it started"
        self._ready.set()
        for done in runs.values():
            done(Outcome(error=f"the agent program's worker process exited with code {code} while it ran "
                               "this trajectory", cause="program_process_exited"))

    def run(self, run: int, message: bytes, done: Callable[[Outcome], None]) -> bool:
        """Send the pickled ``run`` message; False when the worker has gone (``done`` is not called)."""
        with self.lock:
            if not self.alive:
                return False
            self.runs[run] = done
        if not self.channel.send_pickled(message):
            with self.lock:
                self.runs.pop(run, None)
            return False
        return True

    def stop(self) -> None:
        self.channel.send(("stop",))
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.channel.close()


class ProgramProcesses:
    """The worker processes of one ``ProgramDriver``: runs are spread over them (the least busy
    first), and their in-process clients' calls are answered by ``routes``."""

    def __init__(self, ref: str, count: int, routes: Routes, host: str = "127.0.0.1",
                 max_active: int = 256) -> None:
        self.ref, self.count = ref, count
        self._routes, self._host, self._max_active = routes, host, max_active
        self._workers: list[_Worker | None] = [None] * count
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start every worker not running (at once: they import the program side by side)."""
        with self._lock:
            fresh = [self._start(index) for index, worker in enumerate(self._workers)
                     if worker is None or not worker.alive]
        for worker in fresh:
            worker.wait_ready(self.ref)

    def _start(self, index: int) -> _Worker:
        worker = self._workers[index] = _Worker(index, self.ref, self._call, self._host, self._max_active)
        return worker

    def run(self, task: Any, key: str, done: Callable[[Outcome], None]) -> Callable[[], Any]:
        """Start the program for one trajectory; ``done`` gets its outcome (on a channel's thread).
        Returns what cancels it (past its time limit)."""
        run = next(self._ids)
        try:
            message = pickle.dumps(("run", run, task, key), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            done(Outcome(error=f"the trajectory's task cannot be sent to the agent program's worker process "
                               f"({type(exc).__name__}: {exc}); keep the data row's values plain (text, numbers, "
                               "lists, dicts)", cause="program_task_unsendable"))
            return lambda: None
        for _ in range(2):  # a worker found dead is started again once
            with self._lock:
                live = [w for w in self._workers if w is not None and w.alive]
                if len(live) < self.count:
                    dead = next(i for i, w in enumerate(self._workers) if w is None or not w.alive)
                    worker = self._start(dead)
                else:
                    worker = min(live, key=lambda w: len(w.runs))
            worker.wait_ready(self.ref)
            if worker.run(run, message, done):  # pickled once, above: an unsendable task fails there
                return lambda: worker.channel.send(("cancel", run))
        done(Outcome(error="the agent program's worker process could not be started for this trajectory",
                     cause="program_process_exited"))
        return lambda: None

    def pids(self) -> list[int]:
        """The process ids of the workers running now."""
        with self._lock:
            return [w.process.pid for w in self._workers if w is not None and w.alive]

    def _call(self, worker: _Worker, message: tuple) -> None:
        """A worker's in-process client made a request: answer it through the routes."""
        _, call, method, path, headers, body = message

        def reply(answer: Any) -> None:
            head = [(name.decode(), value.decode()) for name, value in answer.head()]
            worker.channel.send(("answer", call, answer.status, head, b"".join(answer.chunks())))

        self._routes.call_dispatched(method, path, headers, body, reply)

    def close(self) -> None:
        with self._lock:
            workers, self._workers = self._workers, [None] * self.count
        for worker in workers:
            if worker is not None:
                worker.stop()


# -- the worker's side -------------------------------------------------------------------------------


class _Gateway:
    """The gateway as a worker's programs see it, at the worker's own base URL: its HTTP server
    (``_Relaying``) and, registered under that URL, the in-process clients
    (``gateway_http.http_client``), both carrying each request over the channel to the driver."""

    def __init__(self, channel: Channel, calls: dict[int, concurrent.futures.Future], host: str,
                 max_active: int) -> None:
        self._channel, self._calls = channel, calls
        self._ids = itertools.count()
        self._clients: dict[bool, Any] = {}
        self._lock = threading.Lock()
        self.server = GatewayServer(_Relaying(self), host, 0, max_active=max_active)
        self.base_url = base_url_of(host, self.server.server_address[1])
        register(self.base_url, self)

    def request(self, method: str, path: str, headers: dict[str, str], body: bytes) -> concurrent.futures.Future:
        """Send a request to the driver; the future gets its answer: status, headers, body."""
        call = next(self._ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls[call] = future
        if not self._channel.send(("call", call, method, path, headers, body)):
            self._calls.pop(call, None)
            future.set_exception(ConnectionError("the Relax gateway's process has gone"))
        return future

    def in_process(self, sync: bool = True) -> Any:
        with self._lock:
            client = self._clients.get(sync)
            if client is None:
                client = self._clients[sync] = _channel_client(self, sync)
            return client


class _Relaying(Admission):
    """The routes of a worker's own HTTP server: the route, the method and the body's size are
    checked here, before the body is read; the key, the per-key bound and the call itself by the
    driver, to which each request is relayed. The HTTP of the worker's programs is thus parsed in
    the worker's interpreter, not in the rollout's."""

    def __init__(self, gateway: _Gateway) -> None:
        self.gateway = gateway

    def check_key(self, key: str | None) -> None:
        """Checked by the driver, when the request reaches it (a worker knows no keys)."""

    async def answer(self, method: str, path: str, headers: dict[str, str], raw: bytes) -> Answer:
        status, head, content = await asyncio.wrap_future(self.gateway.request(method, path, headers, raw))
        return Relayed(status, headers=head, content=content)


def _channel_client(gateway: _Gateway, sync: bool) -> Any:
    import httpx2

    def response(answered: tuple, request: Any) -> Any:
        status, headers, content = answered
        return httpx2.Response(status, headers=headers, content=content, request=request)

    class Transport(httpx2.BaseTransport):
        def handle_request(self, request: Any) -> Any:
            return response(gateway.request(*request_parts(request), request.read()).result(), request)

    class AsyncTransport(httpx2.AsyncBaseTransport):
        async def handle_async_request(self, request: Any) -> Any:
            body = await request.aread()
            return response(await asyncio.wrap_future(gateway.request(*request_parts(request), body)), request)

    if sync:
        return httpx2.Client(transport=Transport(), base_url=gateway.base_url, timeout=None)
    return httpx2.AsyncClient(transport=AsyncTransport(), base_url=gateway.base_url, timeout=None)


def serve(fd: int, ref: str, host: str, max_active: int) -> None:
    """A worker's life: import the program, start its gateway, then run what the driver sends
    until it says stop."""
    import inspect

    calls: dict[int, concurrent.futures.Future] = {}
    runs: dict[int, Any] = {}
    stopped = threading.Event()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="relax-agent-programs", daemon=True).start()

    def on_message(message: tuple) -> None:
        kind = message[0]
        if kind == "answer":
            future = calls.pop(message[1], None)
            if future is not None:
                future.set_result(message[2:])
        elif kind == "run":
            start(*message[1:])
        elif kind == "cancel":
            running = runs.get(message[1])
            if running is not None:
                running.cancel()
        elif kind == "stop":
            stopped.set()

    def on_closed() -> None:
        for future in list(calls.values()):
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_exception(ConnectionError("the Relax gateway's process has gone"))
        stopped.set()

    channel = Channel(Connection(fd), on_message, on_closed, name="relax-agent-program-channel")
    try:
        program = load_program(ref)
    except Exception as exc:
        channel.send(("broken", str(exc)))
        return
    is_async = inspect.iscoroutinefunction(program)
    gateway = _Gateway(channel, calls, host, max_active)
    base_url = gateway.base_url

    def finish(run: int, outcome: Outcome) -> None:
        runs.pop(run, None)
        channel.send(("done", run, outcome))

    def start(run: int, task: Any, key: str) -> None:
        if is_async:
            future = asyncio.run_coroutine_threadsafe(program(task, base_url, key), loop)
            runs[run] = future
            future.add_done_callback(lambda f: finish(run, _outcome_of(f, ref)))
            return

        def on_thread() -> None:
            try:
                result = program(task, base_url, key)
                if inspect.isawaitable(result):
                    result = asyncio.run(_awaited(result))
            except BaseException as exc:  # reported to the driver, never raised on this thread
                finish(run, raised(exc))
            else:
                finish(run, checked_reward(result, ref))

        threading.Thread(target=on_thread, name=f"agent-program-{run}", daemon=True).start()

    channel.start()
    channel.send(("ready",))
    stopped.wait()
    loop.call_soon_threadsafe(loop.stop)
    channel.close()


def _outcome_of(future: concurrent.futures.Future, ref: str) -> Outcome:
    if future.cancelled():
        return Outcome(error="cancelled past its time limit", raised="CancelledError")
    exc = future.exception()
    return raised(exc) if exc is not None else checked_reward(future.result(), ref)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def main() -> None:
    """The worker process's entry (``python -c``, so that its classes pickle under this module's name)."""
    sys.path[:] = json.loads(sys.argv[3])
    serve(int(sys.argv[1]), sys.argv[2], sys.argv[4], int(sys.argv[5]))
    # Program threads still blocked on a call are abandoned with the process (as a driver's are).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
