"""One run's trace across processes: the root, one span per step, role spans under their step,
train-step links to the rollout batches consumed; and the cost-free disabled path."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import relax
from relax.spec.models import RunSpec
from relax.telemetry import (
    CHECKPOINT,
    NULL_SPAN,
    REWARD_SCORE,
    ROLLOUT_BATCH,
    RUN,
    STEP,
    TRAIN_STEP,
    WEIGHT_SYNC,
    Telemetry,
    link_from,
    links_from,
    read_spans,
    step_span_id,
)
from relax.telemetry.analysis import summarize, to_chrome_trace

STEPS = 4
ROWS = 4


@dataclass(frozen=True)
class RowMeta:
    """The fields of ``relax.bus.RowMeta`` that tracing uses (importing the bus costs seconds)."""

    policy_version: int
    sample_id: str
    trace: dict[str, str] = field(default_factory=dict)


class SharedSink(InMemorySpanExporter):
    """One in-memory sink for several simulated processes: one process's shutdown must not close it."""

    def shutdown(self) -> None:
        pass


def spec_of(exporter: str = "jsonl", **tracing) -> RunSpec:
    return RunSpec(name="sim", tracing={"exporter": exporter, **tracing})


def simulate_run(tmp_path: Path, exporter: SharedSink, sampling_ratio: float = 1.0) -> list[list[str]]:
    """A driver and two worker threads (rollout+reward, actor), each with its own Telemetry.

    The rollout runs ahead of the actor. At odd steps the actor keeps two rows back, so the next
    step trains on them one step late. Returns, per step, the sample ids the actor trained on.
    """
    spec = spec_of(sampling_ratio=sampling_ratio)
    driver = Telemetry.from_spec(spec, tmp_path, "controller", spec_hash="h1", exporter=exporter)
    batches: queue.Queue = queue.Queue(maxsize=1)
    reports: queue.Queue = queue.Queue()
    version = [0]
    trained: list[list[str]] = []

    def rollout(carrier: dict[str, str]) -> None:
        tel = Telemetry.from_spec(spec, tmp_path, "rollout", exporter=exporter, run_carrier=carrier)
        for step in range(STEPS):
            start = time.time()
            v = version[0]
            with tel.span(WEIGHT_SYNC, step=step, role="rollout", policy_version=v):
                pass
            with tel.span(ROLLOUT_BATCH, step=step, policy_version=v, staleness=step - v) as span:
                rows = [RowMeta(policy_version=v, sample_id=f"{step}:{i}", trace=span.carrier()) for i in range(ROWS)]
                span.set(samples=ROWS, tokens=10 * ROWS)
            with tel.span(REWARD_SCORE, step=step, samples=ROWS):
                pass
            batches.put((step, rows))
            reports.put((step, start, time.time()))
        tel.shutdown()

    def actor(carrier: dict[str, str]) -> None:
        tel = Telemetry.from_spec(spec, tmp_path, "actor", exporter=exporter, run_carrier=carrier)
        held: list[RowMeta] = []
        for step in range(STEPS):
            _, rows = batches.get()
            start = time.time()
            rows = held + rows
            held = rows[-2:] if step % 2 == 1 else []
            batch = rows[: len(rows) - len(held)]
            trained.append([m.sample_id for m in batch])
            with tel.span(TRAIN_STEP, step=step, links=batch, samples=len(batch),
                          staleness=step - min(m.policy_version for m in batch)):
                time.sleep(0.002)
            version[0] = step + 1
            with tel.span(WEIGHT_SYNC, step=step, role="actor", policy_version=step + 1):
                pass
            if step == STEPS - 1:
                with tel.span(CHECKPOINT, step=step):
                    pass
            reports.put((step, start, time.time()))
        tel.shutdown()

    with driver.run_span(steps=STEPS) as run:
        carrier = run.carrier()
        threads = [threading.Thread(target=rollout, args=(carrier,)), threading.Thread(target=actor, args=(carrier,))]
        for t in threads:
            t.start()
        seen: dict[int, list[tuple[float, float]]] = {}
        for _ in range(2 * STEPS):  # the controller: a step is done once both roles reported it
            step, start, end = reports.get(timeout=10)
            seen.setdefault(step, []).append((start, end))
            if len(seen[step]) == 2:
                driver.record_step(step, min(s for s, _ in seen[step]), max(e for _, e in seen[step]))
        for t in threads:
            t.join()
    driver.shutdown()
    return trained


def test_simulated_run_forms_one_tree_with_a_span_per_step(tmp_path):
    exporter = SharedSink()
    simulate_run(tmp_path, exporter)
    spans = exporter.get_finished_spans()

    assert len({s.context.trace_id for s in spans}) == 1
    roots = [s for s in spans if s.parent is None]
    assert [r.name for r in roots] == [RUN]
    root = roots[0]
    trace_id = root.context.trace_id

    steps = {s.attributes["relax.step"]: s for s in spans if s.name == STEP}
    assert sorted(steps) == list(range(STEPS))
    for step, span in steps.items():
        assert span.parent.span_id == root.context.span_id
        assert span.context.span_id == step_span_id(trace_id, step)
        assert span.resource.attributes["relax.role"] == "controller"

    work = [s for s in spans if s.name not in (RUN, STEP)]
    assert Counter(s.name for s in work) == {ROLLOUT_BATCH: STEPS, REWARD_SCORE: STEPS, TRAIN_STEP: STEPS,
                                             WEIGHT_SYNC: 2 * STEPS, CHECKPOINT: 1}
    for span in work:  # each role's work hangs under the step it was for
        assert span.parent.span_id == steps[span.attributes["relax.step"]].context.span_id, span.name
    assert {s.attributes["relax.role"] for s in work if s.name == WEIGHT_SYNC} == {"rollout", "actor"}
    assert {s.resource.attributes["relax.role"] for s in work if s.name == REWARD_SCORE} == {"rollout"}
    assert {s.attributes["relax.role"] for s in work if s.name == REWARD_SCORE} == {"reward"}


def test_train_steps_link_the_rollout_batches_they_consumed(tmp_path):
    exporter = SharedSink()
    trained = simulate_run(tmp_path, exporter)
    spans = exporter.get_finished_spans()
    rollout_step = {s.context.span_id: s.attributes["relax.step"] for s in spans if s.name == ROLLOUT_BATCH}
    train = {s.attributes["relax.step"]: s for s in spans if s.name == TRAIN_STEP}

    for step, span in train.items():
        linked = Counter({rollout_step[link.context.span_id]: link.attributes["relax.samples"] for link in span.links})
        expected = Counter(int(sample.split(":")[0]) for sample in trained[step])
        assert linked == expected, step
    # Step 2 trained the two rows held back at step 1: it links to step 1's rollout batch too.
    assert {rollout_step[link.context.span_id] for link in train[2].links} == {1, 2}
    assert train[2].attributes["relax.staleness"] >= 1


def test_spans_carry_the_run_resource(tmp_path):
    spec = RunSpec(name="res-run", tracing={"exporter": "jsonl", "resource_attributes": {"team": "rl",
                                                                                        "relax.run": "spoofed"}})
    exporter = SharedSink()
    tel = Telemetry.from_spec(spec, tmp_path, "rollout", spec_hash="abc123", exporter=exporter)
    with tel.span(ROLLOUT_BATCH, step=0):
        pass
    resource = exporter.get_finished_spans()[0].resource.attributes
    assert resource["service.name"] == "res-run"
    assert resource["relax.run"] == "res-run"  # built-in keys win over resource_attributes
    assert resource["relax.spec_hash"] == "abc123"
    assert resource["relax.version"] == relax.__version__
    assert resource["relax.role"] == "rollout"
    assert resource["host.name"]
    assert resource["team"] == "rl"


def test_service_name_comes_from_the_spec_when_set(tmp_path):
    exporter = SharedSink()
    tel = Telemetry.from_spec(spec_of(service_name="relax-prod"), tmp_path, "actor", exporter=exporter)
    with tel.span(TRAIN_STEP, step=0):
        pass
    assert exporter.get_finished_spans()[0].resource.attributes["service.name"] == "relax-prod"


def test_nested_span_parents_to_the_enclosing_work_span(tmp_path):
    exporter = SharedSink()
    driver = Telemetry.from_spec(spec_of(), tmp_path, "controller", exporter=exporter)
    with driver.run_span() as run:
        worker = Telemetry.from_spec(spec_of(), tmp_path, "actor", exporter=exporter, run_carrier=run.carrier())
        with worker.span(TRAIN_STEP, step=3) as outer:
            with worker.span(WEIGHT_SYNC, step=3) as inner:
                pass
    assert inner.otel.parent.span_id == outer.otel.get_span_context().span_id
    assert outer.otel.parent.span_id == step_span_id(run.otel.get_span_context().trace_id, 3)


def test_an_exception_marks_the_span_as_an_error(tmp_path):
    exporter = SharedSink()
    tel = Telemetry.from_spec(spec_of(), tmp_path, "reward", exporter=exporter)
    with pytest.raises(ValueError), tel.span(REWARD_SCORE, step=0):
        raise ValueError("bad score")
    span = exporter.get_finished_spans()[0]
    assert span.status.status_code == StatusCode.ERROR
    assert [e.name for e in span.events] == ["exception"]


def test_unsampled_run_records_nothing_in_any_process(tmp_path):
    exporter = SharedSink()
    simulate_run(tmp_path, exporter, sampling_ratio=0.0)
    assert exporter.get_finished_spans() == ()


def test_exporter_none_builds_no_provider_and_costs_next_to_nothing(tmp_path):
    tel = Telemetry.from_spec(spec_of("none"), tmp_path, "rollout", run_carrier={"traceparent": "x"})
    assert tel.provider is None and not tel.enabled
    with tel.run_span() as run:
        assert run.carrier() == {}
    assert tel.span(ROLLOUT_BATCH, step=0) is NULL_SPAN
    tel.record_step(0, 0.0, 1.0)
    tel.shutdown()
    assert not (tmp_path / "traces.jsonl").exists()
    n = 100_000
    started = time.perf_counter()
    for step in range(n):
        with tel.span(ROLLOUT_BATCH, step=step, samples=8) as span:
            span.set(tokens=1)
    per_span_us = (time.perf_counter() - started) / n * 1e6
    assert per_span_us < 5, f"{per_span_us:.2f} us per disabled span: the none exporter must do no provider work"


CHILD = """
import json, sys
from relax.spec.models import RunSpec
from relax.telemetry import Telemetry, ROLLOUT_BATCH
spec = RunSpec(name="sim", tracing={"exporter": "jsonl"})
tel = Telemetry.from_spec(spec, sys.argv[1], "rollout", run_carrier=json.loads(sys.argv[2]))
rows = []
for step in range(int(sys.argv[3])):
    with tel.span(ROLLOUT_BATCH, step=step, samples=2) as span:
        rows.append([{"policy_version": step, "sample_id": f"{step}:{i}", "trace": span.carrier()} for i in range(2)])
tel.shutdown()
print(json.dumps(rows))
"""


def test_two_processes_join_one_trace_through_the_jsonl_file(tmp_path):
    spec = spec_of()
    driver = Telemetry.from_spec(spec, tmp_path, "controller")
    actor = None
    with driver.run_span() as run:
        started = time.time()
        child = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), json.dumps(run.carrier()), "2"],
                               capture_output=True, text=True, check=True, timeout=60)
        batches = [[RowMeta(**tag) for tag in rows] for rows in json.loads(child.stdout)]
        actor = Telemetry.from_spec(spec, tmp_path, "actor", run_carrier=run.carrier())
        for step, rows in enumerate(batches):
            with actor.span(TRAIN_STEP, step=step, links=rows):
                pass
            driver.record_step(step, started, time.time())
        actor.shutdown()
    driver.shutdown()

    spans = read_spans(tmp_path / "traces.jsonl")
    assert len({s["trace_id"] for s in spans}) == 1
    by_id = {s["span_id"]: s for s in spans}
    pids = {s["resource"]["process.pid"] for s in spans}
    assert len(pids) == 2
    for span in spans:
        if span["name"] in (ROLLOUT_BATCH, TRAIN_STEP):
            parent = by_id[span["parent_id"]]
            assert parent["name"] == STEP and parent["attributes"]["relax.step"] == span["attributes"]["relax.step"]
    for span in (s for s in spans if s["name"] == TRAIN_STEP):
        (link,) = span["links"]
        assert by_id[link["span_id"]]["name"] == ROLLOUT_BATCH
        assert by_id[link["span_id"]]["attributes"]["relax.step"] == span["attributes"]["relax.step"]
    assert summarize(spans).steps == [1, 2]  # numbered from 1, as in metrics.jsonl (the spans' relax.step is 0-based)
    tids = {e["tid"] for e in to_chrome_trace(spans)["traceEvents"] if e["ph"] == "X"}
    assert len(tids) == 3  # controller, rollout (child process), actor


def test_links_from_takes_carriers_rows_and_row_tags_and_counts_samples(tmp_path):
    tel = Telemetry.from_spec(spec_of(), tmp_path, "rollout", exporter=SharedSink())
    with tel.span(ROLLOUT_BATCH, step=0) as a, tel.span(ROLLOUT_BATCH, step=1) as b:
        pass
    sources = [a.carrier(), RowMeta(0, "0:1", a.carrier()), {"policy_version": 1, "sample_id": "1:0",
                                                              "trace": b.carrier()}, {}, RowMeta(0, "x")]
    links = links_from(sources)
    assert [(link.context.span_id, link.attributes["relax.samples"]) for link in links] == [
        (a.otel.get_span_context().span_id, 2), (b.otel.get_span_context().span_id, 1)]
    assert link_from({}) is None and link_from({"traceparent": "garbage"}) is None
    with tel.span(TRAIN_STEP, step=1) as train:  # links found once the span runs
        train.link(sources)
    assert [link.context.span_id for link in train.otel.links] == [link.context.span_id for link in links]
