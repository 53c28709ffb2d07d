"""The running controller's small local HTTP endpoint, and the client ``relax scale`` uses.

While a run is live, its controller serves on ``127.0.0.1`` (a free port) and writes the address
and a per-run secret to ``<output_dir>/control.json`` (created readable by its owner alone); the
file is removed when the run ends. Two calls:

- ``GET /status``: rollout replicas, sample counters, faults handled so far;
- ``POST /scale`` with ``{"rollout": N}``: add or remove rollout replicas (elastic runs); the
  answer comes once the change is applied (new replicas synced and serving, removed ones drained).

Loopback alone is no defence: any local user, and any web page in the user's browser, can reach
127.0.0.1. So every request must carry ``Authorization: Bearer <secret>`` (else 401: only who can
read ``control.json`` can call), and a POST must be ``Content-Type: application/json`` (else 415:
a browser sends that cross-origin only after a preflight this server never grants). The secret is
checked before a body is read, a body past ``MAX_BODY_BYTES`` is refused unread, each read waits at
most ``READ_TIMEOUT_S``, and at most ``MAX_CONNECTIONS`` connections are served at once (503 past
it; connections that say nothing hold no thread: ``relax.bounded_http``). A malformed request gets
400 with what is wrong; a client that hangs up leaves no trace on the run's console.

Only the standard library here: ``relax scale`` must not import ray or torch.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from relax.bounded_http import HANG_UP, READ_TIMEOUT_S, BoundedHTTPServer, content_length

CONTROL_FILE = "control.json"
#: How long ``relax scale`` waits for the controller to apply a change (new replicas build a model).
SCALE_TIMEOUT_S = 600.0
#: Largest request body read (a scale request is a few bytes).
MAX_BODY_BYTES = 4096
#: Connections served at once: ``relax scale`` makes one call at a time.
MAX_CONNECTIONS = 16


class ControlError(Exception):
    """A control request failed; the message says why and what to do."""


class ControlServer:
    """Serves ``/status`` and ``/scale`` for one run; ``scale(n)`` and ``status()`` are the
    controller's own methods (called from the server's threads)."""

    def __init__(self, output_dir: Path, status: Callable[[], dict[str, Any]],
                 scale: Callable[[dict[str, int]], dict[str, Any]]) -> None:
        self.secret = secrets.token_urlsafe(32)
        self.server = _Server(("127.0.0.1", 0), _handler(status, scale, self.secret))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.file = output_dir / CONTROL_FILE
        # close() waits for the server's next poll: a short one keeps the end of a run prompt.
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="relax-control", daemon=True)
        self._thread.start()
        output_dir.mkdir(parents=True, exist_ok=True)
        write_private(self.file, json.dumps({"url": self.url, "pid": os.getpid(), "secret": self.secret}))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.file.unlink(missing_ok=True)


def write_private(path: Path, text: str) -> None:
    """Write ``path`` readable and writable by its owner alone, from its creation on (a chmod after
    writing leaves a moment when others can read it). A stale file of an earlier run is replaced."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)


class _Server(BoundedHTTPServer):
    """The control endpoint's server: a few connections at once, silent ones on the porter."""

    max_active = MAX_CONNECTIONS
    max_per_key = MAX_CONNECTIONS // 2


def check_scale_request(request: Any) -> dict[str, int]:
    """The body of ``POST /scale`` as ``{"rollout": N}``, or ControlError saying what is wrong."""
    if not isinstance(request, dict) or not request:
        raise ControlError(f'the body must be a JSON object such as {{"rollout": 2}}, not {str(request)[:80]}')
    for role, count in request.items():
        if role != "rollout":
            raise ControlError(f"only the rollout role scales mid-run, not {str(role)[:40]!r}; send {{\"rollout\": N}}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ControlError(f"rollout={str(count)[:40]}: the replica count must be a whole number, 0 or more")
    return request


def _handler(status: Callable[[], dict[str, Any]], scale: Callable[[dict[str, int]], dict[str, Any]],
             secret: str) -> type:
    expected = f"Bearer {secret}".encode()

    class Handler(BaseHTTPRequestHandler):
        timeout = READ_TIMEOUT_S
        """Each read (the request line, headers, body) waits this long: a half-sent request frees
        its thread then."""
        server: _Server

        def _answer(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except HANG_UP:
                self.close_connection = True

        def _authorized(self) -> bool:
            given = self.headers.get("Authorization", "").encode(errors="replace")
            if hmac.compare_digest(given, expected):
                return True
            self._answer(401, {"error": f"no or wrong secret: send 'Authorization: Bearer <secret>' with the "
                                        f"secret from the run's {CONTROL_FILE} (relax scale does)"})
            return False

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if not self._authorized():
                return
            if self.path != "/status":
                return self._answer(404, {"error": f"no {self.path}; use GET /status or POST /scale"})
            self._answer(200, status())

        def do_POST(self) -> None:  # noqa: N802
            if not self._authorized():
                return
            if self.path != "/scale":
                return self._answer(404, {"error": f"no {self.path}; use GET /status or POST /scale"})
            kind = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return self._answer(415, {"error": f"Content-Type must be application/json, not {kind or 'none'!r}"})
            with self.server.key_slot(secret) as granted:
                if not granted:
                    return self._answer(429, {"error": "too many control calls in flight; wait for one to answer"})
                self._scale()

        def _scale(self) -> None:
            length, why = content_length(self.headers, MAX_BODY_BYTES)
            if length is None and why is not None and why.startswith("the body is"):
                self.close_connection = True  # the body stays unread
                return self._answer(413, {"error": f"{why}; send {{\"rollout\": N}}"})
            try:
                request = check_scale_request(json.loads(self._body()))
            except ControlError as exc:
                return self._answer(400, {"error": str(exc)})
            except ValueError as exc:  # not JSON, not UTF-8, no or a bad Content-Length
                return self._answer(400, {"error": f"the body is not a JSON object ({exc})"})
            try:
                self._answer(200, scale(request))
            except ControlError as exc:
                self._answer(400, {"error": str(exc)})
            except Exception as exc:  # the controller's failure, reported to the caller
                self._answer(500, {"error": f"{type(exc).__name__}: {exc}"})

        def _body(self) -> bytes:
            given = self.headers.get("Content-Length") or "none"
            length = int(given) if given.isdigit() else 0
            if not 0 < length <= MAX_BODY_BYTES:
                raise ValueError(f"Content-Length {given[:20]}: a body of 1 to {MAX_BODY_BYTES} bytes is needed")
            return self.rfile.read(length)

        def log_message(self, *args: Any) -> None:  # no access log on the run's console
            return

    return Handler


def parse_scale(items: list[str]) -> dict[str, int]:
    """``["rollout=2"]`` -> ``{"rollout": 2}``; only the rollout role scales."""
    request: dict[str, int] = {}
    for item in items:
        role, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit():
            raise ControlError(f"'{item}' is not ROLE=N; write e.g. rollout=2")
        if role != "rollout":
            raise ControlError(f"only the rollout role scales mid-run, not '{role}'; write rollout=N")
        request[role] = int(value)
    if not request:
        raise ControlError("say what to scale, e.g. rollout=2")
    return request


def control_call(run_dir: Path, method: str, path: str, body: dict[str, Any] | None = None,
                 timeout_s: float = SCALE_TIMEOUT_S) -> dict[str, Any]:
    """One request to the controller of the run in ``run_dir``."""
    file = run_dir / CONTROL_FILE
    if not file.is_file():
        raise ControlError(f"no running controller for {run_dir} (no {CONTROL_FILE}): the run is not live, or "
                           "RUN_DIR is not its trainer.output_dir")
    try:
        found = json.loads(file.read_text())
        url, secret = found["url"] + path, found["secret"]
    except PermissionError:
        raise ControlError(f"cannot read {file}: only the user who started the run can control it") from None
    except (ValueError, KeyError, TypeError):
        raise ControlError(f"{file} is not a live run's control file (no url and secret); the run may have been "
                           "started by an older Relax, or ended") from None
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {secret}"}
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise ControlError(json.loads(exc.read() or b"{}").get("error", str(exc))) from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        raise ControlError(f"the controller at {url} did not answer ({exc}); the run may have ended") from None
