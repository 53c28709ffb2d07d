"""Samples: a few generated rows of a step, so a person sees what the model writes.

Every ``trainer.log_samples_every`` steps the scorer of the step (``relax.runtime.worker.roles.reward``),
which holds the prompts, responses, labels and every reward's score together, picks
``trainer.log_samples`` rows (``choose_rows``) and carries them in its step report, a few short
JSON objects (``sample_row``). The controller writes them to ``<output_dir>/samples.jsonl``
(``SamplesLog``), hands them to the ``logging:`` trackers that take samples (``log_samples``) and
prints one of them (``console_line``). ``relax samples RUN_DIR`` reads the file back
(``read_samples``, ``worst_rows``, ``format_sample``).

A row: ``step``, ``sample_id``, ``policy_version``, ``prompt``, ``response``, ``label``,
``response_tokens``, ``reward`` (the total the advantage sees), ``reward/<id>`` (each reward entry's
own score; absent for an entry the row was not routed to), and for agentic rows ``turns``,
``tool_calls``, ``calls`` (each well-formed call as ``name(arguments)``), ``observations`` (what the
environment answered, cut short), ``outcome`` (the trajectory's typed outcome, as
``relax.agents.outcomes.OUTCOMES`` names them: ``ok``, ``truncated``, ``tool_error``, ``env_error``,
``env_timeout``, ``program_error``, ``infra``) and, for a failed trajectory, ``error`` (what failed,
cut short) and ``cause``. Rows written before outcomes were typed say ``finished`` or ``failed: <error>``;
``relax samples`` prints them as they are.

This module imports only the standard library: ``relax samples`` reads runs without torch or ray.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relax.runtime.jsonl_rows import parse_rows, read_rows

SAMPLES_FILE = "samples.jsonl"

#: Longest prompt, response or label text kept in a row; the rest is cut (and the cut is marked).
TEXT_CHARS = 2000
#: Longest observation or tool call kept (agentic rows), and how many of each a row keeps.
ITEM_CHARS = 300
ITEMS = 8
#: What marks a text cut short.
CUT = " [...]"


def due(step: int, every: int) -> bool:
    """Whether step ``step`` (1-based, as in metrics.jsonl) is a sampled step."""
    return every > 0 and step % every == 0


def choose_rows(rewards: Sequence[float], count: int) -> list[int]:
    """The positions of the rows to keep of a step, at most ``count``, in batch order: the first
    row (what a plain sample of the data looks like), then the best, the worst and rows spread
    between them by reward, so good and bad answers are both seen."""
    total = len(rewards)
    if count <= 0 or total == 0:
        return []
    if count >= total:
        return list(range(total))
    by_reward = sorted(range(total), key=lambda i: (-rewards[i], i))  # best first, ties in batch order
    chosen = [0]
    rest = [i for i in by_reward if i != 0]
    picks = count - 1
    if picks == 1:
        chosen.append(rest[0])
    elif picks > 1:  # evenly over the ranking, both ends included
        last = len(rest) - 1
        for k in range(picks):
            position = round(k * last / (picks - 1))
            index = rest[position]
            if index not in chosen:
                chosen.append(index)
    return sorted(chosen)


def cut(text: Any, limit: int = TEXT_CHARS) -> str:
    """``text`` as a string of at most ``limit`` characters (plus the cut's mark)."""
    text = text if isinstance(text, str) else json.dumps(text, default=str)
    return text if len(text) <= limit else text[:limit] + CUT


def agent_outcome(summary: dict[str, Any]) -> str:
    """How a trajectory ended: its typed outcome (``agent.outcome`` of its metadata, set by the
    trajectory runner); ``ok`` for a summary that names none (it said nothing went wrong)."""
    return str(summary.get("outcome") or "ok")


def sample_row(step: int, prompt: Any, response: Any, label: Any, reward: float, rewards: dict[str, float | None],
               meta: dict[str, Any]) -> dict[str, Any]:
    """One sample of step ``step`` (1-based): its texts (cut), its total ``reward``, each reward
    entry's score (``rewards``: key -> score, None where the entry did not score it) and what its
    metadata says (policy version, tokens, the agent's trajectory)."""
    row: dict[str, Any] = {"step": step, "sample_id": meta.get("sample_id"),
                           "policy_version": meta.get("policy_version"), "prompt": cut(prompt),
                           "response": cut(response), "label": None if label is None else cut(label),
                           "response_tokens": meta.get("response_tokens"), "reward": float(reward)}
    row.update({f"reward/{key}": float(score) for key, score in rewards.items() if score is not None})
    summary = meta.get("agent")
    if isinstance(summary, dict):
        row.update({"turns": summary.get("turns", 0), "tool_calls": summary.get("tool_calls", 0),
                    "calls": [cut(c, ITEM_CHARS) for c in summary.get("calls", [])[:ITEMS]],
                    "observations": [cut(o, ITEM_CHARS) for o in summary.get("observations", [])[:ITEMS]],
                    "outcome": agent_outcome(summary)})
        if summary.get("error"):
            row.update({"error": cut(summary["error"], ITEM_CHARS), "cause": summary.get("cause")})
    return row


# -- the run's file ----------------------------------------------------------------------------------


class SamplesLog:
    """Appends sample rows to samples.jsonl. On a resume from the checkpoint of ``resume_step`` it
    keeps the rows of steps up to it and drops the rest, as ``metrics.jsonl`` does: the resumed run
    samples those steps again (and a line cut short by a crash is not a row)."""

    def __init__(self, output_dir: Path, resume_step: int | None) -> None:
        self.path = Path(output_dir) / SAMPLES_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.unlink(missing_ok=True)
            return
        if self.path.exists():
            kept = [row for row in parse_rows(self.path.read_text(errors="replace")) if row["step"] <= resume_step]
            self.path.write_text("".join(json.dumps(row) + "\n" for row in kept))

    def append(self, rows: Sequence[dict[str, Any]]) -> None:
        if not rows:
            return
        with self.path.open("a") as out:
            out.write("".join(json.dumps(row, default=str) + "\n" for row in rows))


class SamplesError(ValueError):
    """A run folder holds no samples to show; the message says why and what to do."""


def read_samples(run_dir: Path) -> list[dict[str, Any]]:
    """The sample rows a run wrote (``<run_dir>/samples.jsonl``)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise SamplesError(f"{run_dir} is not a folder; give the output_dir of a run (trainer.output_dir)")
    path = run_dir / SAMPLES_FILE
    if not path.is_file():
        raise SamplesError(f"{path} does not exist: the run wrote no samples (trainer.log_samples_every is 0, or "
                           "it ended before its first sampled step); give the output_dir of a run that did")
    return read_rows(path)


def worst_rows(rows: Sequence[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """The ``count`` rows with the lowest total reward, lowest first (ties: earlier steps first)."""
    return sorted(rows, key=lambda r: (float(r.get("reward", 0.0)), r["step"]))[:max(count, 0)]


# -- how a person reads them ------------------------------------------------------------------------


def one_line(text: Any, width: int) -> str:
    """``text`` on one line (its line breaks shown as ``⏎``), cut to ``width`` characters."""
    flat = (text if isinstance(text, str) else json.dumps(text, default=str)).replace("\r", "")
    flat = " ".join(part.strip() for part in flat.split("\n")).strip() if "\n" in flat else flat.strip()
    return flat if len(flat) <= width else flat[:max(width - 1, 0)] + "…"


def console_line(row: dict[str, Any], width: int = 160) -> str:
    """One sample as the progress display prints it: its reward and the agent's outcome, then the
    prompt and the response, each cut so the whole stays within ``width`` characters."""
    head = f"sample reward {float(row.get('reward', 0.0)):.3f}"
    if "outcome" in row:
        head += f" {row['outcome'].split(':')[0]} after {row.get('turns', 0)} turn(s)"
    room = max(width - len(head) - len("  prompt: ''  response: ''"), 20)
    prompt_room = room // 3
    prompt = one_line(row.get("prompt", ""), prompt_room)
    response = one_line(row.get("response", ""), room - len(prompt))
    return f"{head}  prompt: {prompt!r}  response: {response!r}"


def format_sample(row: dict[str, Any]) -> str:
    """One sample as ``relax samples`` prints it: a heading line, then each part on its own lines."""
    rewards = "  ".join(f"{k.removeprefix('reward/')} {v:.3f}" for k, v in row.items()
                        if k.startswith("reward/") and isinstance(v, (int, float)))
    head = (f"step {row['step']}  sample {row.get('sample_id')}  policy v{row.get('policy_version')}  "
            f"reward {float(row.get('reward', 0.0)):.3f}" + (f" ({rewards})" if rewards else ""))
    lines = [head]
    if "outcome" in row:
        lines.append(f"  outcome: {row['outcome']}  turns {row.get('turns', 0)}  tool calls {row.get('tool_calls', 0)}")
        if row.get("error"):
            cause = f" ({row['cause']})" if row.get("cause") and row["cause"] != row["outcome"] else ""
            lines.append(f"  error{cause}: {one_line(row['error'], 300)}")
    for name in ("prompt", "response", "label"):
        value = row.get(name)
        if value is None:
            continue
        lines.append(f"  {name}:")
        lines += ["    " + line for line in str(value).splitlines() or [""]]
    for name in ("calls", "observations"):
        for i, item in enumerate(row.get(name) or [], 1):
            lines.append(f"  {name[:-1]} {i}: {one_line(item, 200)}")
    return "\n".join(lines)
