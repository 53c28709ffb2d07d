"""``overlong_penalty``: DAPO's soft punishment of responses that run close to the length limit.

With ``L`` the response's length in tokens, ``L_max`` the limit and ``B`` the buffer::

    0                          if L <= L_max - B
    -penalty * (L - (L_max - B)) / B   if L_max - B < L <= L_max
    -penalty                   if L > L_max

so a response cut at the limit (most likely unfinished) is discouraged smoothly rather than all at
once. Add it next to a correctness reward (weight 1, ``always: true`` when rewards are routed).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from relax.contracts import RewardSample


class OverlongPenalty:
    """Reads ``metadata["response_tokens"]`` and ``metadata["max_new_tokens"]`` (set by the runtime)."""

    class Config(BaseModel):
        """Options of the overlong penalty."""

        model_config = ConfigDict(extra="forbid")

        max_tokens: int | None = Field(None, ge=1)
        """The length limit L_max in tokens; null takes the rollout's ``max_new_tokens``."""
        buffer: int | None = Field(None, ge=1)
        """The buffer B before the limit where the penalty grows; null takes a fifth of the limit
        (DAPO: 4096 of 20480)."""
        penalty: float = Field(1.0, gt=0.0)
        """The penalty at the limit (the reward is -penalty there and beyond)."""

    def __init__(self, config: OverlongPenalty.Config) -> None:
        self.config = config

    def score(self, samples: list[RewardSample]) -> list[float]:
        cfg = self.config
        scores = []
        for i, sample in enumerate(samples):
            tokens = sample.metadata.get("response_tokens")
            if tokens is None:
                raise ValueError(f"overlong_penalty: sample {i} has no metadata['response_tokens']; the runtime "
                                 "sets it for every generated response")
            limit = cfg.max_tokens or sample.metadata.get("max_new_tokens")
            if limit is None:
                raise ValueError(f"overlong_penalty: sample {i} has no metadata['max_new_tokens']; set "
                                 "options.max_tokens")
            limit = int(limit)
            buffer = cfg.buffer or max(1, limit // 5)
            if buffer > limit:
                raise ValueError(f"overlong_penalty: buffer {buffer} exceeds the length limit {limit}; make "
                                 "options.buffer smaller than the limit")
            excess = int(tokens) - (limit - buffer)
            scores.append(0.0 if excess <= 0 else -cfg.penalty * min(1.0, excess / buffer))
        return scores
