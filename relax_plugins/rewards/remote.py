"""``remote``: scores computed by an HTTP service (a sandbox running code, a verifier, a judge).

Each batch is sent as one JSON POST (or several, ``batch_size`` samples each)::

    {"samples": [{"prompt": "...", "response": "...", "label": ..., "metadata": {...}}, ...]}

and the service answers ``{"scores": [float, ...]}``, one score per sample, in order. Connection
failures, time-outs and the status codes in ``retry_statuses`` are retried with exponential
backoff; any other error status fails at once with the service's own message.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from relax.contracts import RewardSample

#: Characters of an error body quoted in a message.
BODY_EXCERPT = 300


class RemoteRewardError(RuntimeError):
    """The scoring service could not be reached or gave an unusable answer."""


class RemoteReward:
    """Posts samples to a scoring service and returns its scores."""

    class Config(BaseModel):
        """Options of the remote (HTTP) reward."""

        model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

        url: str = "http://127.0.0.1:8000/score"
        """The service's endpoint (http or https)."""
        timeout_s: float = Field(30.0, gt=0.0)
        """Longest wait for one request's answer."""
        retries: int = Field(3, ge=0)
        """Further attempts after a failed one (connection errors, time-outs, ``retry_statuses``)."""
        backoff_s: float = Field(0.5, ge=0.0)
        """Wait before the first retry; each next wait doubles, up to ``max_backoff_s``."""
        max_backoff_s: float = Field(8.0, ge=0.0)
        """Longest wait between two attempts."""
        retry_statuses: list[int] = Field(default_factory=lambda: [408, 429, 500, 502, 503, 504])
        """HTTP statuses worth another attempt (overload, a gateway hiccup); others fail at once."""
        batch_size: int | None = Field(None, ge=1)
        """Samples per request; null sends the whole batch in one request."""
        headers: dict[str, str] = Field(default_factory=dict)
        """Extra request headers."""
        token_env: str | None = None
        """Name of an environment variable holding a bearer token for the ``Authorization``
        header (keeps the secret out of the spec)."""

        @field_validator("url")
        @classmethod
        def _http(cls, value: str) -> str:
            if not value.startswith(("http://", "https://")):
                raise ValueError("must start with http:// or https://")
            return value

    def __init__(self, config: RemoteReward.Config) -> None:
        self.config = config
        self.headers = {"Content-Type": "application/json", "Accept": "application/json", **config.headers}
        if config.token_env:
            token = os.environ.get(config.token_env)
            if not token:
                raise RemoteRewardError(f"remote: the environment variable {config.token_env} (options.token_env) "
                                        "is not set in this process; export it where the reward workers run")
            self.headers["Authorization"] = f"Bearer {token}"

    def score(self, samples: list[RewardSample]) -> list[float]:
        size = self.config.batch_size or max(1, len(samples))
        scores: list[float] = []
        for start in range(0, len(samples), size):
            scores += self._post(samples[start:start + size])
        return scores

    def _post(self, samples: list[RewardSample]) -> list[float]:
        cfg = self.config
        body = json.dumps({"samples": [{"prompt": s.prompt, "response": s.response, "label": s.label,
                                        "metadata": s.metadata} for s in samples]}, default=str).encode()
        attempts = cfg.retries + 1
        wait = cfg.backoff_s
        last = ""
        for attempt in range(1, attempts + 1):
            request = urllib.request.Request(cfg.url, data=body, headers=self.headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=cfg.timeout_s) as response:
                    return self._scores(response.read(), len(samples))
            except urllib.error.HTTPError as exc:
                detail = exc.read()[:BODY_EXCERPT].decode(errors="replace").strip()
                last = f"HTTP {exc.code} {exc.reason}" + (f": {detail}" if detail else "")
                if exc.code not in cfg.retry_statuses:
                    raise RemoteRewardError(f"remote: POST {cfg.url} answered {last}; fix the request or the "
                                            "service (this status is not retried)") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
                last = f"{type(reason).__name__}: {reason}" if not isinstance(reason, str) else reason
                if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                    last = f"no answer within timeout_s={cfg.timeout_s}"
            if attempt < attempts:
                time.sleep(min(wait, cfg.max_backoff_s))
                wait *= 2
        raise RemoteRewardError(f"remote: POST {cfg.url} failed after {attempts} attempt(s); last: {last}. Check "
                                "that the service is up, or raise options.timeout_s / options.retries")

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
