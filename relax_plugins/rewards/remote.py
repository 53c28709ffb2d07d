"""``remote``: scores computed by an HTTP service (a sandbox running code, a verifier, a judge).

Each batch is sent as one JSON POST (or several, ``batch_size`` samples each)::

    {"samples": [{"prompt": "...", "response": "...", "label": ..., "metadata": {...}}, ...]}

and the service answers ``{"scores": [float, ...]}``, one score per sample, in order. Connection
failures, time-outs and the status codes in ``retry_statuses`` are retried with exponential
backoff; any other error status fails at once with the service's own message.

What it refuses to do, so that a misbehaving or hostile service cannot take more than it is given:

- follow a redirect: the token and headers (``headers``, ``headers_env``) would go to a host the spec never named, and
that host's
  scores would be trusted. A 3xx is an error naming its ``Location``; point ``url`` there.
- wait past ``timeout_s`` for one request: one deadline covers connecting, sending and reading the
  whole answer, so a service trickling bytes is cut off (the socket is shut down at the deadline).
- read an answer of any size: past ``max_answer_bytes`` (4 MiB) it stops reading and the samples it
  was for fail with an error naming the option.
- hammer a failing service: a batch spends at most ``max_failures_per_batch`` failed requests,
  counting retries and the reward runner asking again sample by sample; the rest fail at once.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relax.contracts import RewardSample

#: Characters of an error body quoted in a message.
BODY_EXCERPT = 300


class RemoteRewardError(RuntimeError):
    """The scoring service could not be reached or gave an unusable answer."""


class RemoteReward:
    """Posts samples to a scoring service and returns its scores."""

    class Config(BaseModel):
        """Options of the remote (HTTP) reward."""

        model_config = ConfigDict(extra="forbid")

        url: str = "http://127.0.0.1:8000/score"
        """The service's endpoint (http or https)."""
        timeout_s: float = Field(30.0, gt=0.0)
        """Longest time one request may take, from connecting to the last byte of its answer."""
        retries: int = Field(3, ge=0)
        """Further attempts after a failed one (connection errors, time-outs, ``retry_statuses``)."""
        backoff_s: float = Field(0.5, ge=0.0)
        """Wait before the first retry; each next wait doubles, up to ``max_backoff_s``."""
        max_backoff_s: float = Field(8.0, ge=0.0)
        """Longest wait between two attempts."""
        max_failures_per_batch: int = Field(8, ge=1)
        """Failed requests (errors and time-outs, retries included) one batch may spend. The reward
        runner asks again sample by sample when a batch fails, to find the samples at fault; against
        a service that is down that is one batch request plus one per sample, each retried. Once
        this budget is spent the batch's remaining samples fail at once, without a request."""
        max_answer_bytes: int = Field(4 * 1024 * 1024, ge=1)
        """Largest answer read from the service (a score is a few bytes per sample); a larger one
        is an error for the samples it was for, and only this many bytes (plus one) are read."""
        retry_statuses: list[int] = Field(default_factory=lambda: [408, 429, 500, 502, 503, 504])
        """HTTP statuses worth another attempt (overload, a gateway hiccup); others fail at once."""
        batch_size: int | None = Field(None, ge=1)
        """Samples per request; null sends the whole batch in one request."""
        headers: dict[str, str] = Field(default_factory=dict)
        """Extra request headers. Put no credential here: use ``headers_env`` (or ``${oc.env:...}``,
        which run files show as the expression, never the value)."""
        headers_env: dict[str, str] = Field(default_factory=dict)
        """Request headers whose values are read from the environment where the reward runs:
        header name -> environment variable name (``{X-Api-Key: JUDGE_KEY}``). The spec, the run's
        files and its trackers hold only the variable's name."""
        token_env: str | None = None
        """Name of an environment variable holding a bearer token for the ``Authorization``
        header (keeps the secret out of the spec)."""

        @field_validator("url")
        @classmethod
        def _http(cls, value: str) -> str:
            if not value.startswith(("http://", "https://")):
                raise ValueError("must start with http:// or https://")
            return value

        @model_validator(mode="after")
        def _one_source_per_header(self) -> RemoteReward.Config:
            """A header set twice would silently drop one of its values."""
            from_env = {name.lower() for name in self.headers_env}
            twice = sorted(name for name in self.headers if name.lower() in from_env)
            if twice:
                raise ValueError(f"headers and headers_env both set {', '.join(twice)}; keep it in headers_env")
            if self.token_env and "authorization" in from_env:
                raise ValueError("token_env and headers_env both set Authorization; keep one")
            return self

    def __init__(self, config: RemoteReward.Config) -> None:
        self.config = config
        self._budget: _Budget | None = None
        self.headers = {"Content-Type": "application/json", "Accept": "application/json", **config.headers}
        for header, variable in config.headers_env.items():
            value = os.environ.get(variable)
            if not value:
                raise RemoteRewardError(f"remote: the environment variable {variable} (options.headers_env.{header}) "
                                        "is not set in this process; export it where the reward workers run")
            self.headers[header] = value
        if config.token_env:
            token = os.environ.get(config.token_env)
            if not token:
                raise RemoteRewardError(f"remote: the environment variable {config.token_env} (options.token_env) "
                                        "is not set in this process; export it where the reward workers run")
            self.headers["Authorization"] = f"Bearer {token}"

    def score(self, samples: list[RewardSample]) -> list[float]:
        budget = self._budget_for(samples)
        size = self.config.batch_size or max(1, len(samples))
        scores: list[float] = []
        for start in range(0, len(samples), size):
            scores += self._post(samples[start:start + size], budget)
        return scores

    def _budget_for(self, samples: list[RewardSample]) -> _Budget:
        """The batch these samples belong to: the last one when they all came in it (the reward
        runner asking again sample by sample), else a new batch with a full budget."""
        last = self._budget
        if last is None or not samples or not all(id(s) in last.ids for s in samples):
            last = self._budget = _Budget(samples, self.config.max_failures_per_batch)
        return last

    def _post(self, samples: list[RewardSample], budget: _Budget) -> list[float]:
        cfg = self.config
        body = json.dumps({"samples": [{"prompt": s.prompt, "response": s.response, "label": s.label,
                                        "metadata": s.metadata} for s in samples]}, default=str).encode()
        attempts = cfg.retries + 1
        wait = cfg.backoff_s
        last = ""
        for attempt in range(1, attempts + 1):
            if budget.left <= 0:
                raise RemoteRewardError(f"remote: no request sent: this batch already had {budget.spent} failed "
                                        f"request(s) to {cfg.url} (options.max_failures_per_batch); last: "
                                        f"{budget.last or last}. Check that the service is up")
            try:
                return self._scores(self._request(body), len(samples))
            except urllib.error.HTTPError as exc:
                budget.fail(last := _status_line(exc))
                if 300 <= exc.code < 400:
                    raise RemoteRewardError(
                        f"remote: POST {cfg.url} answered {exc.code} {exc.reason}, a redirect to "
                        f"{exc.headers.get('Location') or 'nowhere named'}; redirects are not followed (the token "
                        "and headers would go to another address): set options.url to the final address") from None
                if exc.code not in cfg.retry_statuses:
                    raise RemoteRewardError(f"remote: POST {cfg.url} answered {last}; fix the request or the "
                                            "service (this status is not retried)") from None
            except _Expired:
                budget.fail(last := f"no complete answer within timeout_s={cfg.timeout_s}")
            except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
                reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
                last = f"{type(reason).__name__}: {reason}" if not isinstance(reason, str) else reason
                if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                    last = f"no complete answer within timeout_s={cfg.timeout_s}"
                budget.fail(last)
            if attempt < attempts:
                time.sleep(min(wait, cfg.max_backoff_s))
                wait *= 2
        raise RemoteRewardError(f"remote: POST {cfg.url} failed after {attempts} attempt(s); last: {last}. Check "
                                "that the service is up, or raise options.timeout_s / options.retries")

    def _request(self, body: bytes) -> bytes:
        """One POST and its whole answer within ``timeout_s``; raises ``_Expired`` past it."""
        deadline = _Deadline(self.config.timeout_s)
        opener = urllib.request.build_opener(_NoRedirects, deadline.handler(urllib.request.HTTPHandler),
                                             deadline.handler(urllib.request.HTTPSHandler))
        request = urllib.request.Request(self.config.url, data=body, headers=self.headers, method="POST")
        try:
            with opener.open(request, timeout=self.config.timeout_s) as response:
                raw = response.read(self.config.max_answer_bytes + 1)
        except Exception:
            if deadline.expired:
                raise _Expired() from None
            raise
        finally:
            deadline.cancel()
        if deadline.expired:  # the answer may be cut short: never use it
            raise _Expired()
        if len(raw) > self.config.max_answer_bytes:
            raise RemoteRewardError(f"remote: {self.config.url} answered more than options.max_answer_bytes="
                                    f"{self.config.max_answer_bytes} bytes (the rest was not read); a score is a "
                                    "few bytes per sample: fix the service, or raise options.max_answer_bytes")
        return raw

    def _scores(self, raw: bytes, count: int) -> list[float]:
        url = self.config.url
        try:
            answer: Any = json.loads(raw)
        except ValueError:
            raise RemoteRewardError(f"remote: {url} answered with something that is not JSON: "
                                    f"{raw[:BODY_EXCERPT]!r}") from None
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, list):
            raise RemoteRewardError(f"remote: {url} must answer {{\"scores\": [...]}}; it answered "
                                    f"{str(answer)[:BODY_EXCERPT]}")
        if len(scores) != count:
            raise RemoteRewardError(f"remote: {url} returned {len(scores)} scores for {count} samples; it must "
                                    "return one per sample, in order")
        try:
            return [float(s) for s in scores]
        except (TypeError, ValueError):
            raise RemoteRewardError(f"remote: {url} returned scores that are not all numbers: "
                                    f"{str(scores)[:BODY_EXCERPT]}") from None


def _status_line(exc: urllib.error.HTTPError) -> str:
    detail = exc.read(BODY_EXCERPT).decode(errors="replace").strip()
    return f"HTTP {exc.code} {exc.reason}" + (f": {detail}" if detail else "")


class _Budget:
    """The failed requests one batch may still spend; it knows its samples by identity (the reward
    runner asks again with the very sample objects of the batch)."""

    def __init__(self, samples: list[RewardSample], failures: int) -> None:
        self.samples = list(samples)  # held, so that their ids stay theirs
        self.ids = {id(s) for s in self.samples}
        self.left, self.spent, self.last = failures, 0, ""

    def fail(self, why: str) -> None:
        self.left -= 1
        self.spent += 1
        self.last = why


class _Expired(Exception):
    """A request ran past its deadline."""


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Turns every redirect into the 3xx HTTPError it came as, so nothing is sent to its Location."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class _Deadline:
    """One request's deadline: at ``timeout_s`` after its start the request's socket is shut down,
    which ends any connect, send or read still blocked on it. Socket time-outs alone bound each
    read, not the sum of them: a service sending a byte a second would never time out."""

    def __init__(self, timeout_s: float) -> None:
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(timeout_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def handler(self, base: type) -> urllib.request.BaseHandler:
        """``base`` (urllib's HTTP or HTTPS handler) whose connections report their socket here."""
        deadline = self
        scheme = "https" if issubclass(base, urllib.request.HTTPSHandler) else "http"
        connection = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection

        class Watched(connection):  # type: ignore[misc, valid-type]
            def connect(self) -> None:
                super().connect()
                deadline.watch(self.sock)

        class Handler(base):  # type: ignore[misc, valid-type]
            pass

        def open_(handler: Any, req: Any) -> Any:
            kwargs = {"context": handler._context} if scheme == "https" else {}
            return handler.do_open(Watched, req, **kwargs)

        setattr(Handler, f"{scheme}_open", open_)
        return Handler()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            if self.expired:
                _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                _shut(sock)

    def cancel(self) -> None:
        self._timer.cancel()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed
