"""The running controller's small local HTTP endpoint, and the client ``relax scale`` uses.

While a run is live, its controller serves on ``127.0.0.1`` (a free port) and writes the address
to ``<output_dir>/control.json``; the file is removed when the run ends. Two calls:

- ``GET /status``: rollout replicas, sample counters, faults handled so far;
- ``POST /scale`` with ``{"rollout": N}``: add or remove rollout replicas (elastic runs); the
  answer comes once the change is applied (new replicas synced and serving, removed ones drained).

Only the standard library here: ``relax scale`` must not import ray or torch.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

CONTROL_FILE = "control.json"
#: How long ``relax scale`` waits for the controller to apply a change (new replicas build a model).
SCALE_TIMEOUT_S = 600.0


class ControlError(Exception):
    """A control request failed; the message says why and what to do."""


class ControlServer:
    """Serves ``/status`` and ``/scale`` for one run; ``scale(n)`` and ``status()`` are the
    controller's own methods (called from the server's threads)."""

    def __init__(self, output_dir: Path, status: Callable[[], dict[str, Any]],
                 scale: Callable[[dict[str, int]], dict[str, Any]]) -> None:
        handler = _handler(status, scale)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.file = output_dir / CONTROL_FILE
        # close() waits for the server's next poll: a short one keeps the end of a run prompt.
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="relax-control", daemon=True)
        self._thread.start()
        output_dir.mkdir(parents=True, exist_ok=True)
        self.file.write_text(json.dumps({"url": self.url, "pid": os.getpid()}))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.file.unlink(missing_ok=True)


def _handler(status: Callable[[], dict[str, Any]], scale: Callable[[dict[str, int]], dict[str, Any]]) -> type:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path != "/status":
                return self._answer(404, {"error": f"no {self.path}; use GET /status or POST /scale"})
            self._answer(200, status())

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/scale":
                return self._answer(404, {"error": f"no {self.path}; use GET /status or POST /scale"})
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                self._answer(200, scale(request))
            except ControlError as exc:
                self._answer(400, {"error": str(exc)})
            except Exception as exc:  # the controller's failure, reported to the caller
                self._answer(500, {"error": f"{type(exc).__name__}: {exc}"})

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
    url = json.loads(file.read_text())["url"] + path
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise ControlError(json.loads(exc.read() or b"{}").get("error", str(exc))) from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        raise ControlError(f"the controller at {url} did not answer ({exc}); the run may have ended") from None
