"""``length_penalty``: a reward that is 0 up to a target length and falls linearly beyond it.

    excess  = max(0, len(response) - target_chars)
    reward  = -min(max_penalty, scale * excess / target_chars)

So a response of ``target_chars`` characters or fewer scores 0, one twice as long scores
``-scale``, and no response scores below ``-max_penalty``. Add it to a correctness reward to push
the policy towards short answers:

    rewards:
      - {name: exact_match, weight: 1.0}
      - {name: length_penalty, weight: 0.5, options: {target_chars: 8, scale: 0.25}}

The module imports pydantic and the standard library only: ``relax validate`` imports it to check
the options above, and that must stay fast and free of GPU libraries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field


class Sample(Protocol):
    """What Relax hands a reward (``relax.contracts.RewardSample``): one response to one prompt."""

    prompt: str
    response: str
    label: Any
    metadata: dict[str, Any]


class LengthPenalty:
    """Penalise responses longer than ``target_chars`` (see the module docstring for the formula)."""

    class Config(BaseModel):
        """Options of ``length_penalty``, given under ``rewards[i].options`` in a run spec."""

        model_config = ConfigDict(extra="forbid")

        target_chars: int = Field(8, ge=1)
        """Longest response, in characters, that is not penalised."""
        scale: float = Field(0.25, ge=0.0)
        """Penalty of a response twice as long as the target (it grows linearly with the excess)."""
        max_penalty: float = Field(1.0, gt=0.0)
        """The penalty never exceeds this (the reward never goes below -max_penalty)."""
        strip: bool = True
        """Ignore leading and trailing whitespace when measuring a response."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def length(self, text: str) -> int:
        """Characters the penalty counts."""
        return len(text.strip() if self.config.strip else text)

    def score(self, samples: Sequence[Sample]) -> list[float]:
        """One reward per sample, in order: 0 within the target, negative beyond it."""
        cfg = self.config
        rewards = []
        for sample in samples:
            excess = max(0, self.length(sample.response) - cfg.target_chars)
            rewards.append(-min(cfg.max_penalty, cfg.scale * excess / cfg.target_chars) if excess else 0.0)
        return rewards
