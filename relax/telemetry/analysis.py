"""What a run's traces say: per-role busy and idle time, how much rollout overlapped training, and
a Chrome/Perfetto timeline. ``relax trace RUN_DIR [--chrome OUT.json]`` prints ``render_summary``
and writes ``to_chrome_trace``.

Works on the span records of ``relax.telemetry.jsonl`` (plain dicts, times in ns since epoch).
One trace is one run attempt: a resumed run appends a new trace to the same file, so the
functions here split the records by trace id and summarize each attempt on its own.

Definitions (per trace):

- **window**: the ``relax.run`` span; when it is missing (the driver was killed), the first
  start to the last end of the trace's spans.
- **start-up**: from the window's start to the first span of the trace's work (the first
  ``relax.step`` or work span): Ray, the placement and the workers coming up. It is nobody's idle
  time, so it is reported on its own and left out of every role's idle time.
- **busy time of a role**: the length of the union of its work spans (every span but
  ``relax.run`` and ``relax.step``, by their ``relax.role``), clipped to the window after start-up,
  so nested spans are not counted twice. **Idle** = window - start-up - busy.
- **steps** are numbered as ``metrics.jsonl`` numbers them, from 1: the span attribute
  ``relax.step`` holds the step the work is for, counted from 0 (step t's row in metrics.jsonl is
  ``t + 1``, the optimizer steps done), so ``relax trace`` and the timeline show ``t + 1``.
- **overlap**: the length of the intersection of the union of ``relax.rollout.batch`` intervals
  with the union of ``relax.actor.train_step`` intervals: time during which samples were being
  generated while the policy was being trained. It is 0 when the two strictly alternate
  (colocate), and approaches the training time in a well-fed asynchronous run. Its share is
  given of the training time and of the window.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax.telemetry.conventions import ATTR_ROLE, ATTR_STALENESS, ATTR_STEP, ROLLOUT_BATCH, RUN, STEP, TRAIN_STEP
from relax.telemetry.jsonl import TRACES_FILE, read_spans

Interval = tuple[int, int]
NS = 1e9


def load_spans(path: str | Path) -> list[dict[str, Any]]:
    """The span records of a run folder (its ``traces.jsonl``) or of a traces file."""
    path = Path(path)
    if path.is_dir():
        path = path / TRACES_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; give a run's output_dir (with tracing.exporter jsonl) "
                                "or a traces .jsonl file")
    return read_spans(path)


# -- intervals ----------------------------------------------------------------------------------


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of intervals as sorted, disjoint intervals (empty ones dropped)."""
    merged: list[list[int]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def total_length(intervals: Sequence[Interval]) -> int:
    """Summed length of disjoint intervals."""
    return sum(e - s for s, e in intervals)


def intersection_length(a: Sequence[Interval], b: Sequence[Interval]) -> int:
    """Length of the intersection of two sorted lists of disjoint intervals."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            total += end - start
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def clip(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    return [(max(s, window[0]), min(e, window[1])) for s, e in intervals if min(e, window[1]) > max(s, window[0])]


# -- summaries ----------------------------------------------------------------------------------


def role_of(span: dict[str, Any]) -> str:
    """The role of a span record: its ``relax.role`` attribute, else its process's."""
    return str(span.get("attributes", {}).get(ATTR_ROLE) or span.get("resource", {}).get(ATTR_ROLE) or "?")


def split_traces(spans: Iterable[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Span records grouped by trace (run attempt), in order of each trace's first start."""
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        by_trace[span["trace_id"]].append(span)
    return sorted(by_trace.values(), key=lambda group: min(s["start"] for s in group))


@dataclass
class RoleTime:
    """How one role spent the run's window."""

    role: str
    busy_s: float
    idle_s: float
    spans: int

    @property
    def busy_share(self) -> float:
        total = self.busy_s + self.idle_s
        return self.busy_s / total if total > 0 else 0.0


@dataclass
class TraceSummary:
    """The figures of one trace (one run attempt)."""

    trace_id: str
    run: str
    complete: bool
    """Whether the ``relax.run`` span is there (the driver finished, cleanly or not)."""
    start_ns: int
    wall_s: float
    steps: list[int]
    """Steps with a ``relax.step`` span, numbered from 1 as in metrics.jsonl."""
    spans: int
    roles: dict[str, RoleTime] = field(default_factory=dict)
    rollout_s: float = 0.0
    train_s: float = 0.0
    overlap_s: float = 0.0
    staleness_max: int | None = None
    errors: int = 0
    startup_s: float = 0.0
    """From the window's start to the first work: not counted as any role's idle time."""

    @property
    def overlap_share_of_train(self) -> float:
        return self.overlap_s / self.train_s if self.train_s > 0 else 0.0

    @property
    def overlap_share_of_run(self) -> float:
        return self.overlap_s / self.wall_s if self.wall_s > 0 else 0.0


def summarize(spans: Sequence[dict[str, Any]]) -> TraceSummary:
    """Busy/idle per role and the rollout/training overlap of the spans of one trace."""
    if not spans:
        raise ValueError("no spans to summarize")
    traces = {s["trace_id"] for s in spans}
    if len(traces) > 1:
        raise ValueError(f"spans of {len(traces)} traces given; split them with split_traces first")
    runs = [s for s in spans if s["name"] == RUN]
    if runs:
        root = max(runs, key=lambda s: s["end"] - s["start"])
        window = (root["start"], root["end"])
    else:
        root = None
        window = (min(s["start"] for s in spans), max(s["end"] for s in spans))
    wall = window[1] - window[0]
    framed = [s["start"] for s in spans if s["name"] != RUN]
    first_work = min(max(min(framed), window[0]), window[1]) if framed else window[0]
    working = (first_work, window[1])
    work: dict[str, list[Interval]] = defaultdict(list)
    counts: dict[str, int] = defaultdict(int)
    rollout: list[Interval] = []
    train: list[Interval] = []
    staleness: list[int] = []
    for span in spans:
        if span["name"] in (RUN, STEP):
            continue
        interval = (span["start"], span["end"])
        role = role_of(span)
        work[role].append(interval)
        counts[role] += 1
        if span["name"] == ROLLOUT_BATCH:
            rollout.append(interval)
        elif span["name"] == TRAIN_STEP:
            train.append(interval)
            if ATTR_STALENESS in span.get("attributes", {}):
                staleness.append(int(span["attributes"][ATTR_STALENESS]))
    roles = {}
    for role in sorted(work):
        busy = total_length(merge_intervals(clip(work[role], working)))
        roles[role] = RoleTime(role, busy / NS, (working[1] - working[0] - busy) / NS, counts[role])
    rollout_u, train_u = merge_intervals(clip(rollout, window)), merge_intervals(clip(train, window))
    any_span = root or spans[0]
    return TraceSummary(
        trace_id=spans[0]["trace_id"],
        run=str(any_span.get("resource", {}).get("relax.run") or any_span.get("resource", {}).get("service.name", "?")),
        complete=root is not None,
        start_ns=window[0],
        wall_s=wall / NS,
        steps=sorted({int(s["attributes"][ATTR_STEP]) + 1 for s in spans
                      if s["name"] == STEP and ATTR_STEP in s.get("attributes", {})}),
        spans=len(spans),
        roles=roles,
        rollout_s=total_length(rollout_u) / NS,
        train_s=total_length(train_u) / NS,
        overlap_s=intersection_length(rollout_u, train_u) / NS,
        staleness_max=max(staleness) if staleness else None,
        errors=sum(1 for s in spans if s.get("status") == "ERROR"),
        startup_s=(first_work - window[0]) / NS,
    )


def summarize_traces(spans: Iterable[dict[str, Any]]) -> list[TraceSummary]:
    """``summarize`` for each trace (run attempt) in the records, oldest first."""
    return [summarize(group) for group in split_traces(spans)]


def render_summary(summaries: Sequence[TraceSummary]) -> str:
    """The text ``relax trace`` prints: one block per run attempt."""
    if not summaries:
        return "no spans recorded (tracing.exporter none, sampling_ratio 0, or the run never started)\n"
    blocks = []
    for n, summary in enumerate(summaries, 1):
        head = f"run {summary.run}"
        if len(summaries) > 1:
            head += f"  (attempt {n} of {len(summaries)})"
        steps = summary.steps
        lines = [
            f"{head}  trace {summary.trace_id}",
            f"  wall {summary.wall_s:.2f} s  steps {len(steps)}"
            + (f" ({steps[0]}..{steps[-1]})" if steps else "")
            + f"  spans {summary.spans}"
            + ("" if summary.complete else "  [no relax.run span: the driver did not finish]")
            + (f"  errors {summary.errors}" if summary.errors else ""),
            f"  start-up {summary.startup_s:.2f} s before the first step's work (not counted as idle)",
            f"  {'role':<12}{'busy s':>9}{'idle s':>9}{'busy':>8}{'spans':>7}",
        ]
        for r in summary.roles.values():
            lines.append(f"  {r.role:<12}{r.busy_s:>9.2f}{r.idle_s:>9.2f}{r.busy_share:>8.1%}{r.spans:>7}")
        lines.append(f"  rollout {summary.rollout_s:.2f} s, training {summary.train_s:.2f} s, overlapping "
                     f"{summary.overlap_s:.2f} s ({summary.overlap_share_of_train:.1%} of training, "
                     f"{summary.overlap_share_of_run:.1%} of the run)")
        if summary.staleness_max is not None:
            lines.append(f"  largest staleness trained: {summary.staleness_max}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


# -- Chrome / Perfetto --------------------------------------------------------------------------


def _track_key(span: dict[str, Any]) -> tuple[str, str, str]:
    resource = span.get("resource", {})
    return (str(resource.get(ATTR_ROLE, "?")), str(resource.get("host.name", "")), str(resource.get("process.pid", "")))


def to_chrome_trace(spans: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The spans as Chrome trace-event JSON (chrome://tracing, ui.perfetto.dev).

    One process (``pid``) per run attempt (trace) and one track (``tid``) per Relax process
    (role worker or controller). Work spans are complete events (``X``); ``relax.step`` spans,
    which overlap in an asynchronous run, are async events on the run; each span link (a train
    step consuming a rollout batch) is a flow arrow. Times are microseconds from the first span.
    """
    events: list[dict[str, Any]] = []
    if not spans:
        return {"traceEvents": events, "displayTimeUnit": "ms"}
    t0 = min(s["start"] for s in spans)

    def us(ns: int) -> float:
        return (ns - t0) / 1000.0

    by_id = {(s["trace_id"], s["span_id"]): s for s in spans}
    tracks: dict[tuple[str, ...], tuple[int, int]] = {}
    flow = 0
    groups = split_traces(spans)
    for pid, group in enumerate(groups, 1):
        run_name = str(group[0].get("resource", {}).get("relax.run", "run"))
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": f"{run_name} ({group[0]['trace_id'][:8]})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        keys = sorted({_track_key(s) for s in group}, key=lambda k: (k[0] != "controller", k))
        for tid, key in enumerate(keys, 1):
            tracks[(group[0]["trace_id"], *key)] = (pid, tid)
            role, host, proc = key
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": f"{role} (pid {proc}{'@' + host if host else ''})"}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    for pid, group in enumerate(groups, 1):
        for span in sorted(group, key=lambda s: (s["start"], -s["end"])):
            pid_tid = tracks[(span["trace_id"], *_track_key(span))]
            args = dict(span.get("attributes", {}))
            args.update(span_id=span["span_id"], parent_id=span.get("parent_id"), status=span.get("status"))
            if span["name"] == STEP:
                step = args[ATTR_STEP] + 1 if isinstance(args.get(ATTR_STEP), int) else "?"  # as metrics.jsonl
                common = {"cat": "relax.step", "name": f"step {step}", "id": span["span_id"], "pid": pid,
                          "tid": pid_tid[1]}
                events.append({**common, "ph": "b", "ts": us(span["start"]), "args": args})
                events.append({**common, "ph": "e", "ts": us(span["end"])})
                continue
            events.append({"ph": "X", "cat": role_of(span), "name": span["name"], "pid": pid_tid[0],
                           "tid": pid_tid[1], "ts": us(span["start"]), "dur": (span["end"] - span["start"]) / 1000.0,
                           "args": args})
            for link in span.get("links", []):
                source = by_id.get((link["trace_id"], link["span_id"]))
                if source is None:
                    continue
                flow += 1
                src_pid, src_tid = tracks[(source["trace_id"], *_track_key(source))]
                events.append({"ph": "s", "cat": "relax.link", "name": "consumed", "id": flow, "pid": src_pid,
                               "tid": src_tid, "ts": us(source["start"])})
                events.append({"ph": "f", "bp": "e", "cat": "relax.link", "name": "consumed", "id": flow,
                               "pid": pid_tid[0], "tid": pid_tid[1], "ts": us(span["start"])})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"traces": sorted({s["trace_id"] for s in spans}), "t0_unix_ns": t0}}
