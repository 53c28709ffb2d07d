"""``relax trace``'s figures from span records: busy and idle per role, rollout/training overlap,
and the Chrome/Perfetto timeline."""

from __future__ import annotations

import json

import pytest

from relax.telemetry import ROLLOUT_BATCH, RUN, STEP, TRAIN_STEP, WEIGHT_SYNC
from relax.telemetry.analysis import (
    intersection_length,
    load_spans,
    merge_intervals,
    render_summary,
    summarize,
    summarize_traces,
    to_chrome_trace,
)

S = 1_000_000_000
PROCESSES = {"controller": 10, "rollout": 11, "actor": 12}


def record(name, start, end, role, *, trace="t1", span_id=None, step=None, process=None, links=(), **attrs):
    """One span record as the jsonl exporter writes it (times in seconds here)."""
    attributes = {"relax.role": role, **{f"relax.{k}": v for k, v in attrs.items()}}
    if step is not None:
        attributes["relax.step"] = step
    process = process or role
    return {"name": name, "trace_id": trace, "span_id": span_id or f"{name}-{start}-{role}", "parent_id": None,
            "start": int(start * S), "end": int(end * S), "status": "UNSET", "attributes": attributes,
            "links": [{"trace_id": trace, "span_id": s, "attributes": {}} for s in links], "events": [],
            "resource": {"relax.role": process, "relax.run": "demo", "process.pid": PROCESSES.get(process, 99),
                         "host.name": "h"}}


def run_of(rollout, train, wall=(0, 10), trace="t1"):
    spans = [record(RUN, *wall, "controller", trace=trace)]
    spans += [record(ROLLOUT_BATCH, s, e, "rollout", step=i, trace=trace, span_id=f"r{i}")
              for i, (s, e) in enumerate(rollout)]
    spans += [record(TRAIN_STEP, s, e, "actor", step=i, trace=trace, links=[f"r{i}"], staleness=1)
              for i, (s, e) in enumerate(train)]
    return spans


def test_overlapping_rollout_and_training_are_measured():
    summary = summarize(run_of(rollout=[(0, 4), (4, 8)], train=[(3, 5), (7, 9)]))
    assert summary.overlap_s == pytest.approx(3.0)  # [3, 5] and [7, 8]
    assert summary.overlap_share_of_train == pytest.approx(0.75)
    assert summary.overlap_share_of_run == pytest.approx(0.3)
    assert summary.roles["rollout"].busy_s == pytest.approx(8.0)
    assert summary.roles["rollout"].idle_s == pytest.approx(2.0)
    assert summary.roles["actor"].busy_s == pytest.approx(4.0)
    assert summary.roles["actor"].busy_share == pytest.approx(0.4)
    assert summary.staleness_max == 1 and summary.complete


def test_alternating_rollout_and_training_do_not_overlap():
    summary = summarize(run_of(rollout=[(0, 2), (4, 6)], train=[(2, 4), (6, 8)]))
    assert summary.overlap_s == 0.0
    assert summary.roles["rollout"].busy_s == pytest.approx(4.0)
    assert summary.roles["actor"].idle_s == pytest.approx(6.0)


def test_nested_and_out_of_window_work_counts_once():
    spans = run_of(rollout=[(1, 3)], train=[(4, 8)], wall=(0, 6))
    spans.append(record(WEIGHT_SYNC, 5, 6, "actor", step=0))  # inside the train step
    summary = summarize(spans)
    assert summary.roles["actor"].busy_s == pytest.approx(2.0)  # clipped to the run's end at 6
    assert summary.roles["actor"].spans == 2


def test_without_a_run_span_the_window_is_the_spans_extent():
    spans = run_of(rollout=[(1, 3)], train=[(3, 5)])[1:]
    summary = summarize(spans)
    assert not summary.complete and summary.wall_s == pytest.approx(4.0)
    assert "no relax.run span" in render_summary([summary])


def test_interval_helpers():
    assert merge_intervals([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9)]) == [(0, 4), (5, 7)]
    assert intersection_length([(0, 4), (5, 7)], [(3, 6)]) == 2


def test_resumed_run_is_summarized_per_attempt(tmp_path):
    first = run_of(rollout=[(0, 2)], train=[(2, 3)], wall=(0, 3), trace="a")
    second = run_of(rollout=[(10, 12)], train=[(11, 13)], wall=(10, 14), trace="b")
    path = tmp_path / "traces.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in second + first))
    summaries = summarize_traces(load_spans(tmp_path))
    assert [s.trace_id for s in summaries] == ["a", "b"]
    assert [s.overlap_s for s in summaries] == [0.0, pytest.approx(1.0)]
    text = render_summary(summaries)
    assert "attempt 1 of 2" in text and "attempt 2 of 2" in text
    assert "rollout" in text and "50.0% of training" in text
    with pytest.raises(ValueError, match="2 traces"):
        summarize(first + second)


def test_missing_traces_file_names_what_to_give(tmp_path):
    with pytest.raises(FileNotFoundError, match="traces.jsonl"):
        load_spans(tmp_path)


def test_chrome_trace_has_a_track_per_process_and_flows_for_links():
    spans = run_of(rollout=[(0, 4), (4, 8)], train=[(3, 5), (7, 9)])
    spans += [record(STEP, 0, 5, "controller", step=0, span_id="s0"),
              record(STEP, 4, 9, "controller", step=1, span_id="s1")]
    chrome = json.loads(json.dumps(to_chrome_trace(spans)))  # plain JSON
    events = chrome["traceEvents"]

    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(name.split()[0] for name in threads.values()) == ["actor", "controller", "rollout"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 5  # the run, two rollout batches, two train steps
    assert {e["pid"] for e in events} == {1}
    tid_of = {e["name"]: threads[e["tid"]].split()[0] for e in complete}
    assert tid_of == {RUN: "controller", ROLLOUT_BATCH: "rollout", TRAIN_STEP: "actor"}
    first_rollout = next(e for e in complete if e["name"] == ROLLOUT_BATCH)
    assert (first_rollout["ts"], first_rollout["dur"]) == (0.0, 4_000_000.0)
    assert first_rollout["args"]["relax.step"] == 0

    steps = [e for e in events if e.get("cat") == "relax.step"]
    # numbered as metrics.jsonl numbers them: the work for step 0 is row 1
    assert sorted((e["ph"], e["name"]) for e in steps) == [("b", "step 1"), ("b", "step 2"), ("e", "step 1"),
                                                           ("e", "step 2")]
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert len(starts) == 2 and starts.keys() == ends.keys()
    for flow_id, start in starts.items():
        assert threads[start["tid"]].startswith("rollout") and threads[ends[flow_id]["tid"]].startswith("actor")


def test_start_up_is_not_idle_and_steps_count_from_1_as_in_metrics():
    """The run starts at 0; its workers come up until 3, when step 0's work starts: those 3 s are
    the start-up, reported on their own, not idle time of every role."""
    spans = run_of(rollout=[(3, 5), (5, 7)], train=[(5, 6), (7, 8)], wall=(0, 10))
    spans += [record(STEP, 3, 6, "controller", step=0, span_id="s0"),
              record(STEP, 5, 8, "controller", step=1, span_id="s1")]
    summary = summarize(spans)
    assert summary.startup_s == pytest.approx(3.0) and summary.wall_s == pytest.approx(10.0)
    assert summary.roles["rollout"].busy_s == pytest.approx(4.0)
    assert summary.roles["rollout"].idle_s == pytest.approx(3.0)  # 7..10, not 0..3
    assert summary.roles["actor"].idle_s == pytest.approx(5.0)
    assert summary.steps == [1, 2]
    text = render_summary([summary])
    assert "steps 2 (1..2)" in text and "start-up 3.00 s before the first step's work" in text


def test_forward_roles_are_counted_under_their_own_names():
    from relax.telemetry import FORWARD

    spans = run_of(rollout=[(0, 2)], train=[(3, 5)], wall=(0, 6))
    spans.append(record(FORWARD, 2, 2.5, "reference", step=0, process="actor"))
    summary = summarize(spans)
    assert summary.roles["reference"].busy_s == pytest.approx(0.5)
    assert "reference" in render_summary([summary])
