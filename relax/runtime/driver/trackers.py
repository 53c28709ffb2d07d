"""The run's experiment trackers (the spec's ``logging:`` list of ``relax.loggers`` plugins).

They live in the driver only, beside ``metrics.jsonl``: the controller hands each one every row it
writes there (``log``), the rows of each sampled step to those that take them (``log_samples``,
optional), and closes them once when the run ends, also on a failure or Ctrl-C
(``close`` with ``finished``, ``failed`` or ``killed``).

A logger that cannot start (a bad option its library refuses, a missing package) stops the run
before any worker starts, with its message: it would fail the same way on every try. A logger
that raises later, while the run trains, is reported once on stderr and left out from then on:
a tracker's hiccup (a full disk, a dropped connection) must not throw away the training, and
``metrics.jsonl`` still holds every row.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TextIO

from relax.contracts import LoggerStatus, PluginKind, RunInfo
from relax.registry import get_registry
from relax.spec.models import RunSpec


class TrackerStartError(RuntimeError):
    """A ``logging:`` entry could not be built; the message names it and says what to do."""


class Trackers:
    """The built loggers of a run, each with the spec path it came from (``logging[i]``)."""

    def __init__(self, loggers: list[tuple[str, Any]] | None = None, stream: TextIO | None = None) -> None:
        self.loggers = list(loggers or [])
        self.stream = stream
        self.closed = False

    @classmethod
    def from_spec(cls, spec: RunSpec, output_dir: Path, start_step: int = 0,
                  stream: TextIO | None = None) -> Trackers:
        """Build every logger the spec lists (none: an empty set that does nothing)."""
        if not spec.logging:
            return cls([], stream)
        registry = get_registry()
        from relax.config.redaction import spec_view

        # Trackers keep the config in their own files (TensorBoard text, MLflow params, wandb's
        # config): they get the redacted view, never a secret (relax.config.redaction).
        run = RunInfo(name=spec.name, output_dir=str(Path(output_dir).resolve()),
                      config=spec_view(spec), start_step=start_step)
        built = cls([], stream)
        for i, entry in enumerate(spec.logging):
            where = f"logging[{i}] ('{entry.name}')"
            try:
                plugin = registry.load(PluginKind.loggers, entry.name)
                logger = plugin(registry.build_config(PluginKind.loggers, entry.name, entry.options), run)
            except Exception as exc:
                built.close("failed")  # those already started end as failed runs, not dangling ones
                raise TrackerStartError(f"{where} could not start: {type(exc).__name__}: {exc}; fix its options "
                                        "or remove it from logging:") from exc
            built.loggers.append((where, logger))
        return built

    def log(self, row: dict[str, Any]) -> None:
        """Hand one metrics row (with its ``step``) to every logger still running."""
        step = int(row["step"])
        for item in list(self.loggers):
            where, logger = item
            try:
                logger.log(step, dict(row))
            except Exception as exc:
                self.loggers.remove(item)
                self._warn(f"{where} failed at step {step} and gets no more rows ({type(exc).__name__}: {exc}); "
                           "metrics.jsonl has every row")
                self._close_one(where, logger, "failed")

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Hand a sampled step's rows (``relax.runtime.samples``) to every running logger that
        takes samples (the contract's optional ``log_samples``); the others get metrics only. A
        failure here is handled like one in ``log``."""
        for item in list(self.loggers):
            where, logger = item
            hook = getattr(logger, "log_samples", None)
            if not callable(hook):
                continue
            try:
                hook(step, [dict(row) for row in rows])
            except Exception as exc:
                self.loggers.remove(item)
                self._warn(f"{where} failed on the samples of step {step} and gets no more rows "
                           f"({type(exc).__name__}: {exc}); metrics.jsonl and samples.jsonl have every row")
                self._close_one(where, logger, "failed")

    def close(self, status: LoggerStatus) -> None:
        """Close every logger once (later calls do nothing)."""
        if self.closed:
            return
        self.closed = True
        for where, logger in self.loggers:
            self._close_one(where, logger, status)
        self.loggers = []

    def _close_one(self, where: str, logger: Any, status: LoggerStatus) -> None:
        try:
            logger.close(status)
        except Exception as exc:
            self._warn(f"{where} failed to close ({type(exc).__name__}: {exc}); its last rows may be missing")

    def _warn(self, message: str) -> None:
        print(f"relax run: {message}", file=self.stream or sys.stderr, flush=True)
