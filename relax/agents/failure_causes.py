"""Failures you can see: each distinct cause of failed trajectories reported once, then counted.

A run whose trajectories fail for one reason (every call of a program refused, a tool server
down) must not look like a run that learns nothing: ``FailureCauses`` keeps, per rollout worker,
every cause seen (``Trajectory.cause``: an exception's type with the refusal code it followed, a
timeout, ...). The first trajectory of a cause is printed with its message; after a unit with
failures one line gives the running count of each cause. The unit's stats count the cause
(``agent_cause/<cause>``, ``agent/cause/<cause>`` in the metrics row) and the row's metadata keeps
it (``agent.cause``, in ``samples.jsonl``).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any, TextIO

#: Characters a cause keeps in a metric name; others become ``_``.
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]")
#: A first message is cut to this many characters in the log.
MESSAGE_CHARS = 500


def cause_of(trajectory: Any) -> str | None:
    """A failed trajectory's cause as a metric-safe name (None: it did not fail)."""
    if trajectory.error is None:
        return None
    return _UNSAFE.sub("_", str(trajectory.cause or trajectory.outcome))[:80]


class FailureCauses:
    """The causes of failed trajectories seen by this worker, with their counts."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.counts: dict[str, int] = {}
        self.out = out

    def note(self, trajectories: Sequence[Any]) -> dict[str, float]:
        """Count a unit's failed trajectories, print each new cause with its first message and the
        running counts; the unit's stats (``agent_cause/<cause>``: how many failed so)."""
        unit: dict[str, float] = {}
        lines = []
        for t in trajectories:
            cause = cause_of(t)
            if cause is None:
                continue
            if cause not in self.counts:
                message = str(t.error)
                message = message if len(message) <= MESSAGE_CHARS else message[:MESSAGE_CHARS] + " [...]"
                lines.append(f"relax agent: trajectories fail with {cause} (first of this cause): {message}")
            self.counts[cause] = self.counts.get(cause, 0) + 1
            unit[f"agent_cause/{cause}"] = unit.get(f"agent_cause/{cause}", 0.0) + 1.0
        if unit:
            lines.append("relax agent: failed trajectories so far, by cause: " + ", ".join(
                f"{cause} {n}" for cause, n in sorted(self.counts.items(), key=lambda kv: -kv[1])))
            out = self.out or sys.stderr
            print("\n".join(lines), file=out, flush=True)
        return unit
