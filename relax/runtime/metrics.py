"""Per-step metrics: one JSON object per step in ``<output_dir>/metrics.jsonl``, and the progress
display (a ``rich`` bar on a terminal, plain lines otherwise, both with the time left).

Each role reports its own timings for a step to ``RunState``; the controller joins them here.
Time keys (seconds): ``time/step_s`` wall time between two optimizer steps; ``time/rollout_s``
generating; ``time/reward_s`` and ``time/advantage_s`` scoring; ``time/train_s`` the train step;
``time/wait_s`` the rollout held back by the staleness bound (its lease, then its weights);
``time/data_wait_s`` the actor waiting for its batch; ``time/weight_sync_s`` publishing and
loading weights; ``time/bus_s`` bus calls of all roles. ``time/work_frac`` is (generating +
scoring + training) / step time, summed over roles, so it exceeds 1 when they overlap.

Mismatch keys (``relax.algo.mismatch``, from the actor's train step): ``mismatch/kl``,
``mismatch/max_abs``, ``mismatch/frac_over`` and ``mismatch/tokens``, counted only on rows the
rollout generated with the very weights the trainer held (stale rows are left out; a step with none
has ``mismatch/tokens`` 0 and no other mismatch key). ``mismatch_alarm`` says when ``mismatch/kl``
is above ``async_policy.mismatch.kl_alarm``; the progress printer then adds an alarm line.

Health keys, in every row (``health_figures``): ``response_length/mean``, ``response_length/max``,
``response_length/clip_frac`` (from the rollout's unit stats), ``prompt_length/mean``,
``reward/std``, ``reward/min``, ``reward/max`` (from the scorer) and ``entropy`` (the trainer's
``entropy``; null when it reports none). The progress display also prints one sample of each
sampled step (``relax.runtime.samples``) and hints (``Progress.note``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from relax.roles import CRITIC_VALUES, STEP_ROLES, Role
from relax.runtime.jsonl_rows import parse_rows, read_rows
from relax.runtime.samples import console_line
from relax.spec.models import MismatchSpec

METRICS_FILE = "metrics.jsonl"
#: How wide a sample's line is where the stream is not a terminal (logs, CI).
PLAIN_WIDTH = 200
EVAL_FILE = "eval.jsonl"
"""Every evaluation of the run (``data.eval``), one line each: the ``eval/*`` figures and the
``step`` of the metrics row they were written into."""


def step_row(step: int, reports: dict[str, dict[str, Any]], step_s: float) -> dict[str, Any]:
    """The metrics.jsonl object of one finished step (``step`` counts optimizer steps done)."""
    rollout, reward, advantage, actor = (reports[r] for r in STEP_ROLES)
    work = rollout["rollout_s"] + reward["reward_s"] + advantage["advantage_s"] + actor["train_s"]
    row: dict[str, Any] = {
        "step": step,
        "reward/mean": reward["reward_mean"],
        "staleness/max": actor["staleness_max"],
        "staleness/mean": actor["staleness_mean"],
        "staleness/bound": rollout.get("staleness_bound", actor.get("staleness_max", 0)),
        "policy_version/rollout": rollout["policy_version"],
        "time/step_s": step_s,
        "time/rollout_s": rollout["rollout_s"],
        "time/reward_s": reward["reward_s"],
        "time/advantage_s": advantage["advantage_s"],
        "time/train_s": actor["train_s"],
        "time/wait_s": rollout["admission_wait_s"],
        "time/data_wait_s": actor["data_wait_s"],
        "time/weight_sync_s": actor["publish_s"] + rollout["weight_load_s"],
        "time/bus_s": rollout["bus_s"] + reward["bus_s"] + advantage["bus_s"] + actor["collate_s"],
        "time/checkpoint_s": actor["checkpoint_s"],
        "weights/sync_bytes": actor.get("sync_bytes", 0),
        "time/work_frac": work / step_s if step_s > 0 else 0.0,
        "throughput/tokens_per_s": rollout["response_tokens"] / step_s if step_s > 0 else 0.0,
        "data/order": rollout["data_order"],
    }
    row.update({f"train/{k}": v for k, v in actor["train"].items()})
    row.update(health_figures(rollout, reward, actor["train"]))
    row.update(actor.get("mismatch", {}))  # mismatch/* keys as they are
    # Per reward entry: mean, count, errors and time (``reward/<id>/mean`` ...).
    row.update({f"reward/{k}": v for k, v in reward.get("rewards", {}).items()})
    if rollout.get("partial_samples"):  # partial rollouts: per sample, over the step
        samples = rollout["partial_samples"]
        row.update({"partial/interrupted_frac": rollout["partial_interrupted"] / samples,
                    "partial/versions_per_sample_mean": rollout["partial_versions"] / samples,
                    "partial/swaps": rollout["partial_swaps"], "partial/calls": rollout["partial_calls"]})
    if "skipped_samples" in rollout:  # multimodal runs: rows replaced for bad media
        row["data/skipped_samples"] = rollout["skipped_samples"]
    if "agent_turns" in rollout:  # agentic rollouts: per trajectory, over the step
        row.update({"agent/turns_mean": rollout["agent_turns"], "agent/tool_calls_mean": rollout["agent_tool_calls"],
                    "agent/tool_errors": rollout["agent_tool_errors"], "agent/failed": rollout["agent_failed"],
                    "agent/env_s": rollout["agent_env_s"],
                    "agent/truncated_frac": rollout["agent_truncated"],
                    "agent/segments_mean": rollout.get("agent_segments", 1.0),
                    "agent/regenerated": rollout.get("agent_regenerated", 0.0)})
        # agent/outcome/<kind> (how many trajectories ended so), agent/malformed_calls/<format> and
        # agent/cause/<cause> (failed trajectories per cause, relax.agents.failure_causes)
        row.update({"agent/" + k[len("agent_"):]: v for k, v in rollout.items()
                    if k.startswith(("agent_outcome/", "agent_malformed_calls/", "agent_cause/"))})
    if "sampling_rounds" in rollout:  # dynamic sampling (dapo)
        row["sampling/rounds"] = rollout["sampling_rounds"]
        row["sampling/filter_rate"] = rollout["sampling_filter_rate"]
        row["sampling/topped_up_groups"] = rollout["sampling_topped_up"]
    # The optional model roles: their compute counts as work; the critic's metrics are its own.
    for name in (Role.reference, Role.actor_fwd, CRITIC_VALUES):
        if name in reports:
            row[f"time/{name}_s"] = reports[name]["forward_s"]
            work += reports[name]["forward_s"]
    if Role.critic in reports:
        critic = reports[Role.critic]
        row["time/critic_train_s"] = critic["train_s"]
        work += critic["train_s"]
        row.update({f"critic/{k}": v for k, v in critic["train"].items()})
    row["time/work_frac"] = work / step_s if step_s > 0 else 0.0
    return row


def health_figures(rollout: dict[str, Any], reward: dict[str, Any], train: dict[str, Any]) -> dict[str, Any]:
    """The figures every row has whatever the run, to tell at a glance whether training is sound:
    response and prompt lengths (``response_length/clip_frac``: the share cut short by
    ``max_new_tokens`` or, agentic, by a budget), how the rewards spread, and the policy's mean
    token entropy over the response tokens as the trainer measured it (null when the trainer does
    not report ``entropy``)."""
    samples = rollout.get("rollout_samples", 0)
    entropy = train.get("entropy")
    return {
        "response_length/mean": rollout["response_tokens"] / samples if samples else 0.0,
        "response_length/max": rollout.get("response_tokens_max", 0),
        "response_length/clip_frac": rollout.get("clipped", 0) / samples if samples else 0.0,
        "prompt_length/mean": rollout.get("prompt_tokens", 0) / samples if samples else 0.0,
        "reward/std": reward.get("reward_std", 0.0),
        "reward/min": reward.get("reward_min", reward["reward_mean"]),
        "reward/max": reward.get("reward_max", reward["reward_mean"]),
        "entropy": None if entropy is None else float(entropy),
    }


class MetricsLog:
    """Appends step rows to metrics.jsonl; on resume from the checkpoint of ``resume_step``, keeps
    the rows of steps 1..``resume_step`` (the resumed run writes ``resume_step + 1`` next) and drops
    the rest: rows past the checkpoint, which the resumed run writes again, and a row cut short by a
    crash, which is not a row."""

    def __init__(self, output_dir: Path, resume_step: int | None) -> None:
        self.path = output_dir / METRICS_FILE
        self.eval_path = output_dir / EVAL_FILE
        output_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
            self.eval_path.unlink(missing_ok=True)
            return
        if self.path.exists():
            kept = [json.dumps(row) for row in kept_rows(self.path.read_text(errors="replace"), resume_step)]
            self.path.write_text("".join(line + "\n" for line in kept))
        if self.eval_path.exists():  # every evaluation written with a kept row
            kept = [json.dumps(row) for row in read_rows(self.eval_path) if row["step"] <= resume_step]
            self.eval_path.write_text("".join(line + "\n" for line in kept))

    def append(self, row: dict[str, Any]) -> None:
        _append_line(self.path, json.dumps(row), f"the row of step {row.get('step')}")

    def evaluated_versions(self) -> list[int]:
        """The policy versions eval.jsonl holds an evaluation of (after a resume: those of the kept
        rows), so the resumed run does not evaluate them again."""
        if not self.eval_path.exists():
            return []
        return sorted({int(row["eval/version"]) for row in read_rows(self.eval_path)})

    def append_eval(self, step: int, figures: dict[str, float]) -> None:
        """An evaluation, written with the row of ``step`` (eval.jsonl keeps every one)."""
        _append_line(self.eval_path, json.dumps({"step": step, **figures}), f"the evaluation of step {step}")


def kept_rows(text: str, resume_step: int) -> list[dict[str, Any]]:
    """The rows of ``text`` (metrics.jsonl) that a resume from step ``resume_step`` keeps: whole
    rows of steps up to it, each step once (the first row written for it)."""
    rows: dict[int, dict[str, Any]] = {}
    for row in parse_rows(text):
        if row["step"] <= resume_step:
            rows.setdefault(row["step"], row)
    return [rows[step] for step in sorted(rows)]


def _append_line(path: Path, line: str, what: str) -> None:
    """Append one jsonl line; a full disk is ``DiskFull`` naming the file (the run stops: a resume
    would write to the same disk), and a part of the line that got written is cut off again so
    the file still ends with a whole row."""
    from relax.runtime.failure_class import as_disk_full

    size = path.stat().st_size if path.exists() else 0
    try:
        with path.open("a") as out:
            out.write(line + "\n")
    except OSError as exc:
        full = as_disk_full(exc, path, what)
        try:
            os.truncate(path, size)
        except OSError:
            pass  # readers skip a row cut short (parse_rows)
        if full is not None:
            raise full from exc
        raise


def mismatch_alarm(figures: dict[str, Any], spec: MismatchSpec | None) -> str | None:
    """The alarm's text when ``figures['mismatch/kl']`` is above ``spec.kl_alarm``; None when it is
    not, when no token was counted, or when the alarm is off."""
    if spec is None or spec.kl_alarm is None:
        return None
    kl = figures.get("mismatch/kl")
    if kl is None or kl <= spec.kl_alarm:
        return None
    return (f"mismatch/kl {kl:.4g} is above async_policy.mismatch.kl_alarm={spec.kl_alarm:g} "
            f"(over {figures.get('mismatch/tokens', 0):.0f} tokens; largest |log-ratio| "
            f"{figures.get('mismatch/max_abs', 0.0):.3g}): the rollout and the trainer disagree on the "
            "same weights (see docs/off-policy.md)")


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; give the output_dir of a run")
    return read_rows(path)  # a row cut short (a crash, a full disk) is skipped, not an error


def format_duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``2 h 07 min``: a duration as a person reads it."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class StepPace:
    """When the run will end, from the steps it has finished: the mean time between steps in this
    process times the steps left. The first step of a process also holds the pipeline filling, so
    until a second one finishes the estimate is that step's own ``time/step_s``."""

    def __init__(self, total: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.clock = total, clock
        self._first: tuple[int, float] | None = None
        self._last_step_s = 0.0

    def update(self, step: int, step_s: float) -> float:
        """Record that ``step`` (1-based, as in metrics.jsonl) finished; the seconds left."""
        now = self.clock()
        if self._first is None:
            self._first = (step, now)
        self._last_step_s = step_s
        return self.eta_s(step, now)

    def eta_s(self, step: int, now: float) -> float:
        left = max(0, self.total - step)
        first_step, first_at = self._first if self._first is not None else (step, now)
        per_step = (now - first_at) / (step - first_step) if step > first_step else self._last_step_s
        return left * per_step


class Progress:
    """The run's progress: a live bar (``rich``) when the stream is a terminal, one plain line per
    step otherwise (logs, CI, a notebook's captured stream), each with the time left."""

    def __init__(self, total: int, stream: TextIO | None = None, mismatch: MismatchSpec | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.stream = stream or sys.stdout
        self.tty = _is_terminal(self.stream)
        self.mismatch = mismatch
        """``async_policy.mismatch``: a step above its ``kl_alarm`` gets an alarm line."""
        self.pace = StepPace(total, clock)
        self._bar: Any = None  # the rich progress display, started at the first step on a terminal
        self._task: Any = None

    @staticmethod
    def figures(row: dict[str, Any]) -> str:
        return (f"reward {row['reward/mean']:.3f}  staleness {row['staleness/max']}  "
                f"{row['throughput/tokens_per_s']:.0f} tok/s  {row['time/step_s']:.2f} s/step "
                f"(gen {row['time/rollout_s']:.2f} train {row['time/train_s']:.2f} "
                f"sync {row['time/weight_sync_s']:.3f} wait {row['time/wait_s']:.2f})")

    def update(self, row: dict[str, Any]) -> None:
        step = row["step"]
        eta = f"ETA {format_duration(self.pace.update(step, row['time/step_s']))}" if step < self.total else "done"
        text = f"{self.figures(row)}  {eta}"
        alarm = mismatch_alarm(row, self.mismatch)
        if self.tty:  # the time left first: a narrow terminal cuts the line's end
            self._show(step, f"{eta}  {self.figures(row)}")
            if alarm is not None:
                self._bar.console.print(f"[relax] step {step}: MISMATCH ALARM: {alarm}", markup=False, highlight=False)
            if step >= self.total:
                self.close()
            return
        self.stream.write(f"[relax] step {step}/{self.total}  {text}\n")
        if alarm is not None:
            self.stream.write(f"[relax] step {step}: MISMATCH ALARM: {alarm}\n")
        self.stream.flush()

    def sample(self, row: dict[str, Any]) -> None:
        """One sample of a sampled step (``relax.runtime.samples``), cut to one line of the
        terminal (or of ``PLAIN_WIDTH`` characters in plain lines)."""
        prefix = f"[relax] step {row['step']}: "
        self._line(prefix + console_line(row, self._width() - len(prefix)))

    def note(self, step: int, text: str) -> None:
        """A line of its own about ``step`` (a hint), printed whole."""
        self._line(f"[relax] step {step}: {text}")

    def _width(self) -> int:
        if self.tty:
            import shutil

            return self._bar.console.width if self._bar is not None else shutil.get_terminal_size().columns
        return PLAIN_WIDTH

    def _line(self, text: str) -> None:
        if self._bar is not None:  # above the live bar, which stays at the bottom
            self._bar.console.print(text, markup=False, highlight=False, soft_wrap=True)
            return
        self.stream.write(text + "\n")
        self.stream.flush()

    def _show(self, step: int, text: str) -> None:
        if self._bar is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
            from rich.progress import Progress as Bar
            from rich.table import Column

            console = Console(file=self.stream, highlight=False)
            # the figures take what the bar leaves, cut at the terminal's edge, never wrapped
            figures = TextColumn("{task.description}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis"))
            self._bar = Bar(TextColumn("step"), MofNCompleteColumn(), BarColumn(bar_width=24), figures,
                            console=console, expand=True, auto_refresh=False, transient=False,
                            redirect_stdout=False, redirect_stderr=False)
            self._bar.start()
            self._task = self._bar.add_task(text, total=self.total, completed=0)
        self._bar.update(self._task, completed=step, description=text)
        self._bar.refresh()

    def close(self) -> None:
        """End the live bar (it stays on screen with its last figures); a no-op for plain lines."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or file-less stream
        return False


def evaluations_for_row(evals: list[dict[str, float]],
                        row: int) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """Split the evaluations the controller holds into those metrics row ``row`` takes (of versions
    up to ``row``) and those of newer versions, kept for their own rows: an evaluation goes into the
    row of the step that made its version or a later one. The controller can lag the workers (while
    it restarts one), so one step's reports may already carry a later version's evaluation, the
    final one included."""
    return ([e for e in evals if e["eval/version"] <= row], [e for e in evals if e["eval/version"] > row])
