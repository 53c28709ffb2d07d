"""How a trajectory ended, as one typed outcome, and what follows from it for training.

Every trajectory ends with exactly one outcome (its sample's ``agent.outcome``):

- caused by the model, scored and trained as any sample: ``ok``; ``truncated`` (a turn or token
  budget spent); ``tool_error`` (it ended normally, but the model made a call that was refused:
  malformed, an unknown tool, arguments that do not fit, or a tool that rejected its input);
- caused by what the model does not control, kept out of training: ``env_error`` (the environment
  raised), ``env_timeout`` (an environment call ran past ``tool_timeout_s``), ``program_error`` (the
  agent program behind the gateway failed), ``infra`` (a server or the connection to it went away).

An infrastructure outcome says nothing about the policy, so its sample is kept out of the
advantage's group statistics (the group's mean and std are over its healthy samples only; the
sample's own advantage is 0) and out of the loss (zero loss mask). These are a trajectory's
failures: a run whose share of them passes ``roles.rollout.agent.max_failed_frac`` (default 0.5)
stops with ``InfraFailureLimit`` naming the outcomes and the first failure, instead of training on a
broken environment or program.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: Every outcome, in the order metrics list them (``agent/outcome/<kind>``).
OUTCOMES: tuple[str, ...] = ("ok", "truncated", "tool_error", "env_error", "env_timeout", "program_error", "infra")
#: Outcomes the model caused: scored and trained as today.
MODEL_OUTCOMES = frozenset({"ok", "truncated", "tool_error"})
#: Outcomes infrastructure caused: out of group statistics and the loss.
INFRA_OUTCOMES = frozenset({"env_error", "env_timeout", "program_error", "infra"})


class InfraFailureLimit(RuntimeError):
    """Too many trajectories ended by infrastructure failures: the run stops, naming them (a
    restart would meet the same broken environment)."""


def outcome_of(meta: Mapping[str, Any]) -> str:
    """A sample's outcome from its row metadata: ``agent.outcome``; ``ok`` for a sample that is not
    a trajectory (a single-turn rollout)."""
    summary = meta.get("agent")
    if not isinstance(summary, Mapping):
        return "ok"
    return str(summary.get("outcome", "ok"))


def healthy(meta: Sequence[Mapping[str, Any]]) -> list[bool]:
    """Per sample: whether it enters the advantage's statistics (its outcome is not an
    infrastructure one)."""
    return [outcome_of(m) not in INFRA_OUTCOMES for m in meta]


def linked_rows(meta: Sequence[Any]) -> dict[int, int]:
    """The rows of a trajectory's earlier segments (``agent.linked``), each mapped to the row of its
    last segment (same ``group`` and ``sample``): that row alone is scored and counts in the
    advantage's statistics, and the linked rows share its reward and advantage. ``meta``: row
    metadata as dicts, or bus rows (their ``extra``)."""
    extras = [getattr(m, "extra", m) or {} for m in meta]
    last: dict[tuple[Any, Any], int] = {}
    linked: list[tuple[int, tuple[Any, Any]]] = []
    for i, extra in enumerate(extras):
        key = (extra.get("group"), extra.get("sample"))
        summary = extra.get("agent")
        if isinstance(summary, Mapping) and summary.get("linked"):
            linked.append((i, key))
        else:
            last[key] = i
    missing = [i for i, key in linked if key not in last]
    if missing:
        raise ValueError(f"rows {missing} are earlier segments of trajectories whose last segment's row is not in "
                         "the batch; a trajectory's segments travel together (one sample, several rows)")
    return {i: last[key] for i, key in linked}


def count(outcomes: Sequence[str]) -> dict[str, float]:
    """How many of each outcome (every outcome named, zeros included)."""
    return {kind: float(sum(o == kind for o in outcomes)) for kind in OUTCOMES}


def check_failed_frac(counts: Mapping[str, float], limit: float | None, first_error: str = "") -> None:
    """Raise ``InfraFailureLimit`` when the failed trajectories (infrastructure outcomes) among
    ``counts`` are more than ``limit`` of all (None: no limit)."""
    if limit is None:
        return
    total = sum(counts.values())
    infra = sum(counts.get(kind, 0.0) for kind in INFRA_OUTCOMES)
    if total <= 0 or infra / total <= limit:
        return
    named = ", ".join(f"{kind} {int(counts[kind])}" for kind in OUTCOMES if kind in INFRA_OUTCOMES and counts.get(kind))
    first = f"; the first: {first_error}" if first_error else ""
    raise InfraFailureLimit(f"{int(infra)} of {int(total)} trajectories failed ({named}), more than "
                            f"roles.rollout.agent.max_failed_frac={limit:g}{first}; fix the environment, its servers "
                            "or the agent program and resume, or raise the fraction")
