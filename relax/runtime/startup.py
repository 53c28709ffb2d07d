"""Where the time from ``relax run`` to the first finished step goes.

A user who times a run against another trainer sees the start-up before any step; this clock splits
it into phases (imports, the model build, Ray, the bus, placement groups, the workers building their
plugins, the first step itself), prints them at the end of the run and keeps them in
``<run>/startup.json``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

#: The phases in the order a run goes through them.
PHASES = ("imports", "model", "ray", "bus", "placement", "workers", "first_step")
STARTUP_FILE = "startup.json"


def process_started_at() -> float:
    """When this process started (wall clock), so the imports before ``relax run`` count too."""
    import psutil

    return psutil.Process().create_time()


class StartupClock:
    """Marks the end of each start-up phase; a phase's time is the wall time since the previous
    mark. Marks after the first step are ignored: a resume's second start-up is not the run's."""

    def __init__(self, started_at: float | None = None) -> None:
        self.started_at = started_at if started_at is not None else time.time()
        self._last = self.started_at
        self.phases: dict[str, float] = {}

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

    @property
    def total_s(self) -> float:
        return sum(self.phases.values())

    def line(self) -> str:
        """One line for the end of the run."""
        parts = ", ".join(f"{p.replace('_', ' ')} {self.phases[p]:.1f}" for p in PHASES if p in self.phases)
        what = "to the first step" if self.done else "before the run ended (no step finished)"
        return f"start-up: {self.total_s:.1f} s {what} ({parts})"

    def write(self, output_dir: Path) -> None:
        record = {"total_s": self.total_s, "phases_s": {p: self.phases[p] for p in PHASES if p in self.phases}}
        (output_dir / STARTUP_FILE).write_text(json.dumps(record, indent=1) + "\n")
