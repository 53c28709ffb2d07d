"""One trajectory's tokens as the model read and wrote them, and its record on the bus.

Tokens are appended in two kinds: the model's (loss mask 1, with their behaviour log-probs and the
policy version that chose them) and everything else after the prompt (observations and the chat
template's tokens: loss mask 0, log-prob 0). Turn boundaries are kept as ``[start, end)`` spans of
the response, so a trainer or a metric can find each model turn.

``to_generation`` hands the trajectory to the rest of the data path as a ``Generation`` with
``loss_mask`` and ``token_versions``: from there it is one sample like any other (one unit of
work for staleness, exactly-once data, restarts and scaling).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from relax.contracts import Generation
from relax.media import MediaRef


@dataclass
class Trajectory:
    """A trajectory being built: its tokens, masks, log-probs, versions, and what happened."""

    prompt_ids: list[int]
    prompt_media: list[MediaRef] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    media: list[MediaRef] = field(default_factory=list)
    """References of the media in the response (observations), in token order."""
    turns: list[tuple[int, int]] = field(default_factory=list)
    """``[start, end)`` of each model turn within the response tokens."""
    final_text: str = ""
    """The last model turn's text: what the reward plugins score."""
    tool_calls: int = 0
    tool_errors: int = 0
    env_s: float = 0.0
    turn_reward: float = 0.0
    agent_reward: float | None = None
    """A reward the agent program gave (gateway): it replaces the reward plugins' score."""
    truncated: bool = False
    error: str | None = None
    """Why the trajectory was ended by a failure (the environment raised or hung); it stays in the
    batch with a zero loss mask."""
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def all_media(self) -> list[MediaRef]:
        return self.prompt_media + self.media

    def add_model(self, ids: list[int], logprobs: list[float], version: int) -> None:
        """Append a model turn's tokens."""
        start = len(self.response_ids)
        self.response_ids += ids
        self.logprobs += [float(x) for x in logprobs]
        self.loss_mask += [1] * len(ids)
        self.versions += [int(version)] * len(ids)
        self.turns.append((start, len(self.response_ids)))

    def add_context(self, ids: list[int], media: list[MediaRef] | None = None) -> None:
        """Append tokens the model did not choose (an observation, the template's)."""
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.versions += [0] * len(ids)
        self.media += list(media or [])

    def to_generation(self, prompt_index: int, masked: bool = False) -> Generation:
        """The trajectory as one sample; ``masked``: keep it, but with a zero loss mask."""
        mask = [0] * len(self.loss_mask) if masked or self.error is not None else list(self.loss_mask)
        return Generation(prompt_index=prompt_index, prompt_ids=list(self.prompt_ids),
                          response_ids=list(self.response_ids), logprobs=list(self.logprobs),
                          text=self.final_text, finished=not self.truncated and self.error is None,
                          loss_mask=mask, token_versions=list(self.versions))

    def summary(self) -> dict[str, Any]:
        """Small facts for the row's metadata (``agent``), the metrics and the scorer."""
        out: dict[str, Any] = {"turns": len(self.turns), "tool_calls": self.tool_calls,
                               "tool_errors": self.tool_errors, "truncated": self.truncated,
                               "env_s": round(self.env_s, 6), "turn_reward": self.turn_reward,
                               "turn_spans": [list(t) for t in self.turns]}
        if self.agent_reward is not None:
            out["reward"] = self.agent_reward
        if self.error is not None:
            out["error"] = self.error
        if self.info:
            out["info"] = self.info
        return out
