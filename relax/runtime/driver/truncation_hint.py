"""A hint when an agentic run's trajectories (nearly) all end truncated.

A trajectory that only ever truncates earns the reward of an unfinished answer every time: the
run trains, its figures move, and nothing is learned. The usual causes are few and each has a
field to change, so the run says so once (``TruncationHint``), on the first step whose
``agent/truncated_frac`` is at least ``TRUNCATED_FRAC``, naming the likeliest cause first from the
step's own figures (``truncation_hint``).
"""

from __future__ import annotations

from typing import Any

from relax.spec.models import AgentSpec

#: A step whose trajectories are truncated at least this often gets the hint.
TRUNCATED_FRAC = 0.9


def truncation_hint(row: dict[str, Any], agent: AgentSpec | None) -> str | None:
    """The hint for a metrics row of an agentic run (``agent`` is ``roles.rollout.agent``), or None
    when its trajectories are not (nearly) all truncated or the run is not agentic."""
    frac = row.get("agent/truncated_frac")
    if agent is None or frac is None or frac < TRUNCATED_FRAC:
        return None
    turns = float(row.get("agent/turns_mean", 0.0))
    calls = float(row.get("agent/tool_calls_mean", 0.0))
    per_turn = "roles.rollout.agent.max_new_tokens" + (
        f"={agent.max_new_tokens}" if agent.max_new_tokens is not None else
        " (null: roles.rollout.sampling.max_new_tokens)")
    causes = []
    if agent.gateway is None and calls == 0:
        causes.append("the model made no tool call the environment accepts: it never wrote a "
                      f"roles.rollout.agent.tool_call_format={agent.tool_call_format} call, or calls tools it was not "
                      "trained on (the shipped tiny agent model knows only the tool `calc`); use a model that "
                      "knows the environment's tools and format, or an environment with tools it knows")
    if turns >= agent.max_turns - 1e-6:
        causes.append(f"every trajectory used all roles.rollout.agent.max_turns={agent.max_turns} turns without "
                      "the environment saying done: raise max_turns, or check that the environment ends "
                      "a trajectory on a final answer")
    else:
        causes.append(f"turns were cut at their token budget ({per_turn}) or the trajectory at "
                      f"roles.rollout.agent.max_tokens={agent.max_tokens} before a final answer: raise them; "
                      "a prompt cut at data.max_prompt_tokens can also hide the task or the tool list")
    return (f"{frac:.0%} of the trajectories of step {row['step']} ended truncated (agent/truncated_frac), "
            "so the model is scored on unfinished answers. Likely: " + "; or ".join(causes) +
            ". `relax samples <output_dir>` shows what the model wrote.")


class TruncationHint:
    """Gives the hint once per run: the first row that calls for it, never again after."""

    def __init__(self, agent: AgentSpec | None) -> None:
        self.agent = agent
        self.given = False

    def check(self, row: dict[str, Any]) -> str | None:
        """The hint for ``row`` if it calls for one and none was given yet; else None."""
        if self.given:
            return None
        hint = truncation_hint(row, self.agent)
        self.given = hint is not None
        return hint
