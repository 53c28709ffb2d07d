"""Where the time from ``relax run`` to the first finished step goes, and the time to stop after
the last one.

A user who times a run against another trainer sees the start-up before any step and the shutdown
after the last. Start-up is a few sequential phases (the critical path: imports, the model build,
Ray, the launch, the first step) whose times add up to the whole; inside a phase several parts can
run at once (the driver imports the runtime while Ray starts; the bus starts while the placement
groups and the workers come up), so each part is kept with its own start and end. Both are printed
at the end of the run and kept in ``<run>/startup.json``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

#: The sequential phases, in the order a run goes through them; their times add up to the total.
PHASES = ("imports", "model", "ray", "launch", "first_step")
#: Parts that run inside a phase, possibly at the same time as others, by the phase they belong to.
PARTS = {"runtime_imports": "ray", "bus": "launch", "placement": "launch", "workers": "launch"}
STARTUP_FILE = "startup.json"

_T = TypeVar("_T")


def process_started_at() -> float:
    """When this process started (wall clock), so the imports before ``relax run`` count too."""
    import psutil

    return psutil.Process().create_time()


class StartupClock:
    """Marks the end of each start-up phase (a phase's time is the wall time since the previous
    mark) and records the parts that run inside them. Marks and parts after the first step are
    ignored: a resume's second start-up is not the run's."""

    def __init__(self, started_at: float | None = None) -> None:
        self.started_at = started_at if started_at is not None else time.time()
        self._last = self.started_at
        self.phases: dict[str, float] = {}
        self.parts: dict[str, tuple[float, float]] = {}
        """Part name -> (start, end), seconds since the process started."""
        self.shutdown_s: float | None = None
        """From the last step's report to the end of the run (workers, bus and Ray stopped)."""
        self._last_step_at: float | None = None

    @property
    def done(self) -> bool:
        return "first_step" in self.phases

    def mark(self, phase: str) -> None:
        """``phase`` ended now."""
        if phase not in PHASES:
            raise ValueError(f"unknown start-up phase '{phase}'; the phases are {', '.join(PHASES)}")
        if self.done:
            return
        now = time.time()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now

    def part(self, name: str, started: float, ended: float | None = None) -> None:
        """Part ``name`` ran from ``started`` to ``ended`` (wall clock; now when omitted)."""
        if name not in PARTS:
            raise ValueError(f"unknown start-up part '{name}'; the parts are {', '.join(PARTS)}")
        if self.done:
            return
        ended = time.time() if ended is None else ended
        self.parts[name] = (started - self.started_at, ended - self.started_at)

    def step_finished(self) -> None:
        """A step's report arrived: the first ends the start-up; the last starts the shutdown."""
        self.mark("first_step")
        self._last_step_at = time.time()

    def stopped(self) -> None:
        """The run has stopped everything it started: the shutdown ends now."""
        if self._last_step_at is not None:
            self.shutdown_s = time.time() - self._last_step_at

    @property
    def total_s(self) -> float:
        return sum(self.phases.values())

    def _parts_of(self, phase: str) -> str:
        """The parts inside ``phase``: which ran alongside which, or one after the other."""
        names = [n for n, p in PARTS.items() if p == phase and n in self.parts]
        if not names:
            return ""
        if phase == "launch" and "bus" in self.parts and len(names) > 1:
            others = [n for n in names if n != "bus"]
            bus_end = self.parts["bus"][1]
            overlapped = any(self.parts[n][0] < bus_end for n in others)
            rest = ", ".join(f"{n} {self._span(n):.1f}" for n in others)
            return f" [bus {self._span('bus'):.1f} {'alongside' if overlapped else 'then'} {rest}]"
        return " [" + ", ".join(f"{n.replace('_', ' ')} {self._span(n):.1f}" for n in names) + " alongside]"

    def _span(self, name: str) -> float:
        start, end = self.parts[name]
        return end - start

    def line(self) -> str:
        """One line for the end of the run."""
        parts = ", ".join(f"{p.replace('_', ' ')} {self.phases[p]:.1f}{self._parts_of(p)}"
                          for p in PHASES if p in self.phases)
        what = "to the first step" if self.done else "before the run ended (no step finished)"
        end = f"; shutdown {self.shutdown_s:.1f} s" if self.shutdown_s is not None else ""
        return f"start-up: {self.total_s:.1f} s {what} ({parts}){end}"

    def write(self, output_dir: Path) -> None:
        record = {"total_s": self.total_s, "phases_s": {p: self.phases[p] for p in PHASES if p in self.phases},
                  "parts": {n: {"phase": PARTS[n], "start_s": s, "end_s": e, "s": e - s}
                            for n, (s, e) in self.parts.items()},
                  "shutdown_s": self.shutdown_s}
        (output_dir / STARTUP_FILE).write_text(json.dumps(record, indent=1) + "\n")


class InBackground(Generic[_T]):
    """Runs ``work`` in a daemon thread from construction on, so that the caller goes on with
    something else meanwhile (start-up overlaps waits: Ray starting, the bus starting). ``result()``
    waits for it and returns its value or raises its exception in the caller's thread; ``part``
    names the start-up part it is recorded as on ``clock``."""

    def __init__(self, work: Callable[[], _T], *, name: str, clock: StartupClock | None = None,
                 part: str | None = None) -> None:
        self._work, self._clock, self._part = work, clock, part
        self._value: _T | None = None
        self._error: BaseException | None = None
        self.started_at = time.time()
        self.ended_at: float | None = None
        self._thread = threading.Thread(target=self._run, name=f"relax-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._work()
        except BaseException as exc:  # handed to whoever asks for the result
            self._error = exc
        finally:
            self.ended_at = time.time()
            if self._clock is not None and self._part is not None:
                self._clock.part(self._part, self.started_at, self.ended_at)

    @property
    def finished(self) -> bool:
        return not self._thread.is_alive()

    @property
    def failed(self) -> BaseException | None:
        """Its exception once it ended with one (without waiting)."""
        return self._error if self.finished else None

    def result(self, timeout_s: float | None = None) -> _T:
        """Its value, after waiting for it (up to ``timeout_s``); its exception if it raised one."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"{self._thread.name} did not finish within {timeout_s:g} s")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]
