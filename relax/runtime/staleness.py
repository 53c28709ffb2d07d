"""``async_policy.max_staleness: auto``: the staleness bound the run sets itself.

A wider bound lets the rollout run further ahead of the trainer, which buys speed only while the
rollout is what the step waits for, and costs learning as the samples drift from the policy being
trained. The controller reads both off each step's metrics row, once the step is trained:

- **drift**: ``offpolicy/kl``, the k3 estimate of ``KL(behaviour || trainer)`` over every token
  of the step, measured by the trainer before its first update (staleness and rollout-trainer
  mismatch together: what the loss's importance ratios see);
- **who waits**: ``time/data_wait_s / time/step_s``, the share of the step the actor waited for
  rows: the rollout is the bottleneck when it is above ``auto.wait_frac``.

A bound is judged by the steps admitted under it only (``staleness/bound`` of the row): after a
change, the steps already admitted under the old bound are still trained for a while, and their
drift says nothing about the new one (counting them would narrow a bound that was just narrowed,
down to 0). The rule, applied after each step admitted under the current bound, to the drift of
those steps smoothed (an exponential mean, half weight to the newest step: one step's figure
swings by several times on small batches):

- drift above ``auto.kl_budget``: narrow by one (at once; never below 0);
- a bound just widened, once held ``auto.hold_steps`` steps, that did not make the steps at least
  ``MIN_GAIN`` faster than the bound below it: back to that bound, which is then the ceiling for
  ``RETRY_STEPS`` steps (a wider bound that buys no speed only costs drift);
- else, once the bound was held ``auto.hold_steps`` steps, drift at most half the budget and the
  rollout the bottleneck: widen by one (never above ``auto.max`` or the ceiling);
- else keep it.

The new bound governs the steps admitted from then on (the rollout waits for policy version
``s - bound`` before it generates step ``s``); steps already admitted keep the bound they were
admitted under, so narrowing never drops or regenerates a sample. ``staleness/bound`` in the metrics
(and the ``relax.step`` span) is the bound each step was admitted under. Its limits: it reacts a
step late (the drift of step ``t`` is known once ``t`` is trained), one notch per step, and it
sees the drift the loss corrects, not the reward; a task whose reward suffers before the drift
shows needs a lower ``auto.kl_budget`` or a fixed bound.
"""

from __future__ import annotations

from typing import Any

from relax.spec.models import AutoStalenessSpec


#: Weight of the newest step in the smoothed drift and step time.
SMOOTHING = 0.5
#: A wider bound is kept only if its steps are at least this much faster than the narrower one's.
MIN_GAIN = 0.05
#: Steps a bound that bought no speed stays the ceiling before a wider one is tried again.
RETRY_STEPS = 20


class StalenessController:
    """Chooses the bound step by step (see the module docstring); pure logic."""

    def __init__(self, spec: AutoStalenessSpec) -> None:
        self.spec = spec
        self.bound = spec.start
        self.drift: float | None = None
        """The smoothed ``offpolicy/kl`` of the current bound's steps."""
        self.pace: float | None = None
        """The smoothed ``time/step_s`` of the current bound's steps."""
        self._held = 0
        self._below: tuple[int, float] | None = None
        """Just widened: the bound below and its pace, which the new bound must beat."""
        self._ceiling: tuple[int, int] | None = None
        """(bound, steps left): the widest bound to try while a wider one bought no speed."""

    def update(self, row: dict[str, Any]) -> int:
        """The bound after a trained step's metrics ``row``."""
        spec = self.spec
        if row.get("staleness/bound", self.bound) != self.bound:
            return self.bound  # admitted under an earlier bound: it does not judge this one
        self._held += 1
        if self._ceiling is not None:
            self._ceiling = (self._ceiling[0], self._ceiling[1] - 1) if self._ceiling[1] > 1 else None
        self.drift = _smooth(self.drift, row.get("offpolicy/kl"))
        step_s = float(row.get("time/step_s") or 0.0)
        self.pace = _smooth(self.pace, step_s if step_s > 0 else None)
        drift, held = self.drift, self._held >= spec.hold_steps
        waited = float(row.get("time/data_wait_s") or 0.0) / step_s if step_s > 0 else 0.0
        ceiling = spec.max if self._ceiling is None else min(spec.max, self._ceiling[0])
        if drift is not None and drift > spec.kl_budget:
            self._change(max(self.bound - 1, 0))
        elif held and self._below is not None and self.pace is not None and \
                self.pace > (1 - MIN_GAIN) * self._below[1]:
            self._ceiling = (self._below[0], RETRY_STEPS)
            self._change(self._below[0])
        elif held and drift is not None and drift <= spec.kl_budget / 2 and waited > spec.wait_frac \
                and self.bound < ceiling:
            below = (self.bound, self.pace) if self.pace is not None else None
            self._change(self.bound + 1)
            self._below = below
        elif held:
            self._below = None  # the widened bound earned its place
        return self.bound

    def _change(self, bound: int) -> None:
        """A new bound (or the same one after an excess at 0): its own steps judge it afresh."""
        self.bound, self._held, self.drift, self.pace, self._below = bound, 0, None, None, None


def _smooth(mean: float | None, value: Any) -> float | None:
    """The exponential mean with ``value`` added (``mean`` as it was when there is no value)."""
    if value is None:
        return mean
    return float(value) if mean is None else SMOOTHING * float(value) + (1 - SMOOTHING) * mean
