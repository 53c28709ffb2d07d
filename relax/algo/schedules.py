"""Learning-rate schedules over a run's training steps (``roles.<role>.optimizer.lr_schedule``).

Pure functions of the step: a trainer sets its optimizer's learning rate from the number of
training steps it has taken (its policy version), so the rate of a step is the same in every
backend and after a resume from a checkpoint (the version is saved with it). One training step
takes ``algorithm.updates_per_step`` optimizer updates, all at that step's rate (veRL's
convention: the schedule steps once per training step).

With ``T`` total steps, ``W`` warmup steps, peak ``lr`` and floor ratio ``m``, step ``s`` (0-based)
trains at::

    s < W:   lr * (s + 1) / (W + 1)                          # linear warmup from lr / (W + 1)
    s >= W:  p = (s - W) / (T - 1 - W), clipped to [0, 1]    # p = 0 when T - 1 <= W
             constant: lr
             linear:   lr * (m + (1 - m) * (1 - p))
             cosine:   lr * (m + (1 - m) * (1 + cos(pi * p)) / 2)

so step ``W`` is the first at ``lr`` and the last step ``T - 1`` trains at ``m * lr`` (linear and
cosine). Steps past ``T`` (a run resumed with more steps) stay at the floor. The schedule spans
the run's planned steps: resuming with another ``trainer.steps`` changes it from there on.

No torch here: ``relax validate`` and the tests read it as plain Python.
"""

from __future__ import annotations

import math

#: The schedules ``lr_schedule`` names.
SCHEDULES = ("constant", "linear", "cosine")


def warmup_length(total_steps: int, warmup_steps: int = 0, warmup_ratio: float | None = None) -> int:
    """Warmup steps: ``ceil(warmup_ratio * total_steps)`` when a ratio is given, else
    ``warmup_steps``."""
    if warmup_steps < 0 or total_steps < 0:
        raise ValueError(f"warmup_steps ({warmup_steps}) and total_steps ({total_steps}) must be >= 0")
    if warmup_ratio is None:
        return warmup_steps
    if not 0.0 <= warmup_ratio <= 1.0:
        raise ValueError(f"warmup_ratio {warmup_ratio} is not in [0, 1]; give the share of the run's steps")
    return math.ceil(round(warmup_ratio * total_steps, 9))


def learning_rate(step: int, *, lr: float, total_steps: int, schedule: str = "constant", warmup_steps: int = 0,
                  min_lr_ratio: float = 0.0) -> float:
    """The learning rate of training step ``step`` (0-based) of ``total_steps``: the formula of the
    module docstring, with ``warmup_steps`` the resolved warmup (``warmup_length``)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"lr_schedule '{schedule}' is unknown; use one of {', '.join(SCHEDULES)}")
    if step < 0:
        raise ValueError(f"step {step} is negative; steps count from 0")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio {min_lr_ratio} is not in [0, 1]")
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return lr
    span = total_steps - 1 - warmup_steps
    if span <= 0:  # the run's last step is the warmup's end: a step past it is past the run
        progress = 0.0 if step == warmup_steps else 1.0
    else:
        progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * shape)
