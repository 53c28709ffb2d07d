"""Reward plugins that fail on purpose, registered by ``relax_hostile-0.1.dist-info`` for the
failure-cause catalogue (``tests/hostile/test_failure_causes.py``); the run's workers see them
through ``PYTHONPATH``."""

from __future__ import annotations

import threading

from pydantic import BaseModel, ConfigDict


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InitFails:
    """Cannot be built: its constructor raises (a missing model file, a bad option at run time)."""

    class Config(_Options):
        pass

    def __init__(self, config: Config) -> None:
        raise RuntimeError("init_fails: the judge model file /nowhere/judge.bin is missing")

    def score(self, samples):
        return [0.0 for _ in samples]


class ShortScores:
    """Breaks the reward contract: one score fewer than samples."""

    class Config(_Options):
        pass

    def __init__(self, config: Config) -> None:
        self.config = config

    def score(self, samples):
        return [1.0 for _ in samples][1:]


class AlwaysRaises:
    """Fails on every sample (as a verifier does on labels it cannot parse)."""

    class Config(_Options):
        pass

    def __init__(self, config: Config) -> None:
        self.config = config

    def score(self, samples):
        raise ValueError("always_raises: cannot parse the label")


class NeverReturns:
    """Hangs on its first call (a service that never answers)."""

    class Config(_Options):
        pass

    def __init__(self, config: Config) -> None:
        self.config = config

    def score(self, samples):
        threading.Event().wait()
        return [0.0 for _ in samples]


class FlakyOnce:
    """Fails its first call of the run with ``TransientError`` (a judge service down for a moment),
    then scores every sample 1. The first call leaves ``marker`` on disk, so the worker restarted
    after it scores."""

    class Config(_Options):
        marker: str

    def __init__(self, config: Config) -> None:
        self.config = config

    def score(self, samples):
        from pathlib import Path

        from relax.contracts import TransientError

        marker = Path(self.config.marker)
        if not marker.exists():
            marker.write_text("failed once")
            raise TransientError("flaky_once: the judge service did not answer")
        return [1.0 for _ in samples]


class ExitsProcess:
    """Kills its process on its first call (a native library that aborts, a plugin calling
    ``os._exit``): nothing of its own reaches the controller, which must still name it."""

    class Config(_Options):
        pass

    def __init__(self, config: Config) -> None:
        self.config = config

    def score(self, samples):
        import os

        os._exit(3)
