"""One trajectory's tokens as the model read and wrote them, and its record on the bus.

Tokens are appended in two kinds: the model's (loss mask 1, with their behaviour log-probs and the
policy version that chose them) and everything else after the prompt (observations and the chat
template's tokens: loss mask 0, log-prob 0). Turn boundaries are kept as ``[start, end)`` spans of
the response, so a trainer or a metric can find each model turn.

``to_generation`` hands the trajectory to the rest of the data path as a ``Generation`` with
``loss_mask`` and ``token_versions``: from there it is one sample like any other (one unit of
work for staleness, exactly-once data, restarts and scaling). A trajectory whose history branched
(the gateway's segments) is one sample of several rows: ``to_generations`` gives one per segment,
each with its own prompt and only its own model tokens trained, the last segment's row last.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
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
    failure: str | None = None
    """The outcome of that failure (``env_error``, ``env_timeout``, ``program_error``, ``infra``:
    ``relax.agents.outcomes``); None with an error: the driver's default."""
    cause: str | None = None
    """With an error: its cause, short and the same for every failure of its kind (an exception's
    type, with the refusal code it followed; ``program_timeout``...), what failures are counted and
    first reported by (``relax.agents.failure_causes``); None: the outcome names it."""
    malformed_calls: int = 0
    """Tool calls of the model that the parser refused (``agent/malformed_calls``)."""
    info: dict[str, Any] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    """Each well-formed tool call the model made, as ``name(arguments)`` (what samples show)."""
    observations: list[str] = field(default_factory=list)
    """The text of each observation the environment answered with (what samples show)."""
    segments: list[dict[str, Any]] = field(default_factory=list)
    """The earlier segments of a trajectory whose history branched (the gateway's ``agent.history:
    segments``: a call that did not extend the conversation started a new segment, its prompt the
    newly rendered history). Each entry holds what that segment was (token counts, turns, its
    parent); the tokens above are the last segment's."""
    segment_tokens: list[Generation] = field(default_factory=list)
    """The earlier segments' tokens as the model read and wrote them (``to_generations`` trains
    each), in segment order; ``prompt_index`` is filled in by ``to_generations``."""

    def new_segment(self, prompt_ids: list[int], why: str) -> None:
        """End the current segment (kept in ``segments`` and ``segment_tokens``) and start one on
        ``prompt_ids``."""
        index = len(self.segments)
        self.segments.append({"segment": index, "parent": index - 1 if index else None, "why": why,
                              "prompt_tokens": len(self.prompt_ids), "response_tokens": len(self.response_ids),
                              "model_tokens": sum(self.loss_mask), "turns": len(self.turns)})
        self.segment_tokens.append(Generation(prompt_index=0, prompt_ids=list(self.prompt_ids),
                                              response_ids=list(self.response_ids), logprobs=list(self.logprobs),
                                              text=self.final_text, finished=True, loss_mask=list(self.loss_mask),
                                              token_versions=list(self.versions)))
        self.prompt_ids, self.prompt_media = list(prompt_ids), []
        self.response_ids, self.logprobs, self.loss_mask, self.versions = [], [], [], []
        self.media, self.turns = [], []

    @property
    def spent_before(self) -> int:
        """Tokens after the prompt the earlier segments used (they count in ``agent.max_tokens``)."""
        return sum(int(s["response_tokens"]) for s in self.segments)

    @property
    def outcome(self) -> str:
        """How the trajectory ended (``relax.agents.outcomes.OUTCOMES``)."""
        if self.error is not None:
            return self.failure or "env_error"
        if self.truncated:
            return "truncated"
        if self.tool_errors:
            return "tool_error"
        return "ok"

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

    def to_generations(self, prompt_index: int, masked: bool = False) -> list[Generation]:
        """One row per segment, earlier segments first and the last segment's (``to_generation``)
        last. Each trains only the model tokens of its own segment (a segment's prompt is the
        conversation rendered anew: tokens the model wrote in an earlier segment are context
        there, never trained twice); a failed or ``masked`` trajectory trains none of them."""
        off = masked or self.error is not None
        earlier = [replace(g, prompt_index=prompt_index, finished=not off,
                           loss_mask=[0] * len(g.response_ids) if off else list(g.loss_mask or []))
                   for g in self.segment_tokens]
        return [*earlier, self.to_generation(prompt_index, masked)]

    def linked_summary(self, segment: int) -> dict[str, Any]:
        """The ``agent`` metadata of an earlier segment's row: the trajectory's outcome and truncation
        (a row of a truncated trajectory counts in ``response_length/clip_frac`` like its last row;
        its reward and advantage are the last segment row's, ``linked``), and that segment's own counts."""
        out = {**self.segments[segment], "outcome": self.outcome, "linked": True, "segments": len(self.segments) + 1,
               "truncated": self.truncated}
        if self.error is not None:
            out["error"] = self.error
            out["cause"] = self.cause or self.outcome
        return out

    def summary(self, detail: bool = False) -> dict[str, Any]:
        """Small facts for the row's metadata (``agent``), the metrics and the scorer; ``detail``:
        also the tool calls and observations, cut short (steps whose samples the run shows)."""
        out: dict[str, Any] = {"outcome": self.outcome, "turns": len(self.turns), "tool_calls": self.tool_calls,
                               "tool_errors": self.tool_errors, "truncated": self.truncated,
                               "env_s": round(self.env_s, 6), "turn_reward": self.turn_reward,
                               "turn_spans": [list(t) for t in self.turns]}
        if self.agent_reward is not None:
            out["reward"] = self.agent_reward
        if self.error is not None:
            out["error"] = self.error
            out["cause"] = self.cause or self.outcome
        if self.info:
            out["info"] = self.info
        out["segments"] = len(self.segments) + 1
        if self.segments:
            out["segment"] = len(self.segments)
            out["earlier_segments"] = self.segments
        if detail:
            out["calls"] = [_short(c) for c in self.calls[:DETAIL_ITEMS]]
            out["observations"] = [_short(o) for o in self.observations[:DETAIL_ITEMS]]
        return out


#: Samples' detail (``Trajectory.summary(detail=True)``): at most this many calls and observations,
#: each cut to this many characters, so the row's metadata stays small.
DETAIL_ITEMS = 8
DETAIL_CHARS = 300


def _short(text: str) -> str:
    return text if len(text) <= DETAIL_CHARS else text[:DETAIL_CHARS] + " [...]"
