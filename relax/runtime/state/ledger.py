"""The rollout work ledger: which prompts of which step each rollout replica is generating.

A step's prompts are cut into *units* (``roles.rollout.unit_prompts`` prompts each). A replica
leases a unit, generates it, puts its rows on the bus and acknowledges it. The ledger is what makes
the data exactly-once when replicas fail or come and go:

- a unit is acknowledged once; rows of an *attempt* whose lease was revoked (its replica died or
  hung after the put, before the acknowledgement) are orphans, and readers skip them;
- a dead replica's leased units go back to pending and are generated again (``regenerated``);
- a step's rows are announced to the readers only when every unit of it is acknowledged.

Pure bookkeeping, no Ray: ``RunState`` holds one and serializes calls to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Unit:
    """One lease-able piece of a step: prompt positions ``[start, stop)`` of the step's prompts."""

    step: int
    index: int
    start: int
    stop: int
    attempt: int = 0
    """Incremented on every lease: rows carry it, so a revoked attempt's rows are recognisable."""
    holder: str | None = None
    done: bool = False
    stats: dict[str, Any] = field(default_factory=dict)
    rows: int = 0
    """The rows the acknowledged attempt put on the bus: its samples, or more when a sample is
    several rows (an agent trajectory of several segments: its unit stats' ``rollout_samples``)."""

    def lease(self) -> dict[str, Any]:
        return {"step": self.step, "unit": self.index, "start": self.start, "stop": self.stop,
                "attempt": self.attempt}


@dataclass
class Counters:
    """Samples the run's rollout made and what became of them, since the run last started (a
    resume from a checkpoint starts a new ledger)."""

    produced: int = 0
    """Samples of acknowledged units: each is on the bus exactly once for its readers."""
    regenerated: int = 0
    """Samples leased to a replica that failed before acknowledging them, and leased again."""
    dropped: int = 0
    """Rows on the bus that no step trains: orphans of revoked attempts (a replica that put its
    rows and failed before acknowledging them), counted when a reader skips them."""
    by_holder: dict[str, int] = field(default_factory=dict)
    """Produced samples per replica."""


class RolloutLedger:
    """Units of every step, their leases and acknowledgements."""

    def __init__(self, steps: int, prompts_per_step: int, samples_per_prompt: int, unit_prompts: int,
                 start_step: int = 0) -> None:
        if unit_prompts < 1:
            raise ValueError(f"unit_prompts must be at least 1, got {unit_prompts}")
        self.steps, self.per_step, self.samples = steps, prompts_per_step, samples_per_prompt
        self.unit_prompts = min(unit_prompts, prompts_per_step)
        self.start_step = start_step
        self.counters = Counters()
        self._units: dict[int, list[Unit]] = {}
        self._dropped_attempts: set[tuple[int, int, int]] = set()

    @property
    def units_per_step(self) -> int:
        return -(-self.per_step // self.unit_prompts)

    def units(self, step: int) -> list[Unit]:
        if step not in self._units:
            bounds = range(0, self.per_step, self.unit_prompts)
            self._units[step] = [Unit(step, i, start, min(start + self.unit_prompts, self.per_step))
                                 for i, start in enumerate(bounds)]
        return self._units[step]

    def samples_of(self, unit: Unit) -> int:
        return (unit.stop - unit.start) * self.samples

    # -- leases ------------------------------------------------------------------------------

    def lease(self, holder: str, max_step: int, only_step: int | None = None) -> dict[str, Any] | None:
        """The lowest pending unit (of ``only_step``, or of any step up to ``max_step``), leased to
        ``holder``; None when there is none right now."""
        steps = [only_step] if only_step is not None else range(self.start_step, min(max_step, self.steps - 1) + 1)
        for step in steps:
            for unit in self.units(step):
                if not unit.done and unit.holder is None:
                    unit.holder = holder
                    unit.attempt += 1
                    return unit.lease()
        return None

    def complete(self, holder: str, step: int, index: int, attempt: int, stats: dict[str, Any]) -> bool:
        """Acknowledge a unit's put. False when the lease was revoked meanwhile: that attempt's rows
        are orphans (and another attempt will be, or was, acknowledged instead)."""
        unit = self.units(step)[index]
        if unit.done or unit.holder != holder or unit.attempt != attempt:
            return False
        unit.done, unit.holder, unit.stats = True, None, stats
        samples = self.samples_of(unit)
        unit.rows = int(stats.get("rollout_samples", samples))
        self.counters.produced += samples
        self.counters.by_holder[holder] = self.counters.by_holder.get(holder, 0) + samples
        return True

    def release(self, holder: str) -> int:
        """Revoke every lease of a failed replica; returns the samples that will be regenerated."""
        samples = 0
        for units in self._units.values():
            for unit in units:
                if unit.holder == holder and not unit.done:
                    unit.holder = None
                    samples += self.samples_of(unit)
        self.counters.regenerated += samples
        return samples

    # -- what readers need ---------------------------------------------------------------------

    def step_done(self, step: int) -> bool:
        return all(unit.done for unit in self.units(step))

    def done_through(self) -> int:
        """The last step up to which every step's units are acknowledged (``start_step - 1`` when
        the first is not): where a restarted rollout must pick up, whatever it reported."""
        step = self.start_step
        while step < self.steps and self.step_done(step):
            step += 1
        return step - 1

    def rows(self, step: int) -> int:
        """The rows the step's acknowledged units put on the bus (what its readers take)."""
        return sum(unit.rows for unit in self.units(step) if unit.done)

    def accepted(self, step: int) -> dict[int, int]:
        """Per unit of a step, the attempt whose rows count."""
        return {unit.index: unit.attempt for unit in self.units(step) if unit.done}

    def retried(self, step: int) -> bool:
        """True when some unit of the step was leased more than once (orphan rows may exist)."""
        return any(unit.attempt > 1 for unit in self.units(step))

    def drop(self, step: int, unit: int, attempt: int, rows: int) -> None:
        """A reader skipped ``rows`` orphan rows of a revoked attempt (counted once per attempt)."""
        if (step, unit, attempt) not in self._dropped_attempts:
            self._dropped_attempts.add((step, unit, attempt))
            self.counters.dropped += rows

    def step_stats(self, step: int) -> list[dict[str, Any]]:
        """The acknowledged units' own stats, in unit order."""
        return [unit.stats for unit in self.units(step)]

    def forget(self, step: int) -> None:
        """A trained step's units are no longer needed (steps are trained in order, so no lease
        reaches back to it)."""
        self._units.pop(step, None)
        self.start_step = max(self.start_step, step + 1)
        self._dropped_attempts = {key for key in self._dropped_attempts if key[0] != step}
