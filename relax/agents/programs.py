"""What an agent program is to Relax (``roles.rollout.agent.gateway.program``): how it is found,
and how its end is told back, whether it ran in the rollout's process (``relax.agents.gateway``)
or in a worker process (``relax.agents.program_processes``)."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class ProgramError(ValueError):
    """``roles.rollout.agent.gateway.program`` does not name a callable that can be imported."""


def load_program(ref: str) -> Callable[..., Any]:
    """The agent program ``package.module:function`` names (imported once by the driver, and once by
    each of its worker processes)."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ProgramError(f"roles.rollout.agent.gateway.program={ref!r}: write it as package.module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ProgramError(f"roles.rollout.agent.gateway.program={ref!r}: module {module_name!r} cannot be imported "
                           f"({type(exc).__name__}: {exc}); install its package or put it on PYTHONPATH") from exc
    program = getattr(module, attr, None)
    if program is None:
        raise ProgramError(f"roles.rollout.agent.gateway.program={ref!r}: module {module_name!r} has no {attr!r}")
    if not callable(program):
        raise ProgramError(f"roles.rollout.agent.gateway.program={ref!r}: {attr!r} is a {type(program).__name__}, "
                           "not a callable; give a function program(task, base_url, api_key)")
    return program


@dataclass(frozen=True)
class Outcome:
    """How a program run in a worker ended, as plain values.

    ``reward`` (None: the reward plugins score it) when it returned one, else ``error``: the text the
    trajectory keeps, with ``raised`` (the exception's type name) and ``code`` (an API client
    error's code) when it raised, or ``cause`` (``program_bad_return``) when it returned something
    that is not a reward."""

    reward: float | None = None
    error: str | None = None
    raised: str | None = None
    code: str | None = None
    cause: str | None = None


class ProgramRaised(Exception):
    """A program in a worker raised: its exception's type name, message and code, as the driver's
    own programs' exceptions are reported (``ProgramDriver.episode``)."""

    def __init__(self, type_name: str, message: str, code: str | None) -> None:
        super().__init__(message)
        self.type_name, self.code = type_name, code


def checked_reward(result: Any, name: str) -> Outcome:
    """What a program returned, checked: a finite float or None is its reward; anything else an error."""
    if isinstance(result, bool) or not (result is None or isinstance(result, (int, float))):
        return Outcome(error=f"agent program {name}: returned a {type(result).__name__}; return the "
                             "trajectory's reward (a float) or None (the reward plugins score it)",
                       cause="program_bad_return")
    if result is not None and not math.isfinite(float(result)):
        return Outcome(error=f"agent program {name}: returned the reward {result!r}; a reward is a finite float",
                       cause="program_bad_return")
    return Outcome(reward=None if result is None else float(result))


def raised(exc: BaseException) -> Outcome:
    code = getattr(exc, "code", None)
    return Outcome(error=str(exc), raised=type(exc).__name__, code=code if isinstance(code, str) and code else None)
