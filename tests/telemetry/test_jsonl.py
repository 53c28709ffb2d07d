"""The jsonl span file: what goes in comes back, and many processes can append to one file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from relax.spec.models import RunSpec
from relax.telemetry import ROLLOUT_BATCH, TRAIN_STEP, JsonlSpanExporter, Telemetry, read_spans
from relax.telemetry.tracing import traces_path


def test_round_trip_keeps_ids_parents_attributes_links_and_resource(tmp_path):
    path = tmp_path / "traces.jsonl"
    tel = Telemetry("rollout", JsonlSpanExporter(path), batch=False)
    with tel.span(ROLLOUT_BATCH, step=2, samples=8, tokens=123, bus_bytes=4096) as rollout:
        rollout.otel.add_event("generated", {"n": 8})
        with tel.span("relax.rollout.generate") as child:
            pass
    with tel.span(TRAIN_STEP, step=2, links=[rollout.carrier()] * 3, staleness=1) as train:
        train.set(tags=["a", "b"])
    tel.shutdown()

    records = read_spans(path)
    assert [r["name"] for r in records] == ["relax.rollout.generate", ROLLOUT_BATCH, TRAIN_STEP]
    gen, batch, step = records
    ctx = rollout.otel.get_span_context()
    assert batch["trace_id"] == f"{ctx.trace_id:032x}" and batch["span_id"] == f"{ctx.span_id:016x}"
    assert gen["parent_id"] == batch["span_id"] == f"{child.otel.parent.span_id:016x}"
    assert batch["parent_id"] is None
    assert batch["attributes"] == {"relax.samples": 8, "relax.tokens": 123, "relax.bus_bytes": 4096,
                                   "relax.role": "rollout", "relax.step": 2}
    assert batch["events"][0]["name"] == "generated" and batch["events"][0]["attributes"] == {"n": 8}
    assert step["links"] == [{"trace_id": batch["trace_id"], "span_id": batch["span_id"],
                              "attributes": {"relax.samples": 3}}]
    assert step["attributes"]["relax.tags"] == ["a", "b"]
    assert 0 < batch["start"] <= gen["start"] <= gen["end"] <= batch["end"]
    assert batch["status"] == "UNSET" and batch["kind"] == "INTERNAL"
    assert batch["resource"]["relax.role"] == "rollout"


WRITER = """
import sys
from relax.telemetry import JsonlSpanExporter, Telemetry
tel = Telemetry(sys.argv[2], JsonlSpanExporter(sys.argv[1], max_write_bytes=4096), batch=True)
for i in range(int(sys.argv[3])):
    with tel.span("relax.test", step=i, payload="x" * 300):
        pass
tel.shutdown()
"""


def test_two_processes_appending_to_one_file_write_whole_lines(tmp_path):
    path = tmp_path / "traces.jsonl"
    # Fewer spans than the batch processor's queue holds (2048): past that OpenTelemetry drops spans
    # while its export thread is behind, which on a loaded machine it may be. Each write is at most
    # 4 KiB, so 1500 spans of ~600 bytes still make hundreds of writes from each process.
    n = 1500
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), role, str(n)]) for role in ("a", "b")]
    assert [w.wait(timeout=60) for w in writers] == [0, 0]

    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""
    records = [json.loads(line) for line in lines[:-1]]  # raises if two writes interleaved
    assert len(records) == 2 * n
    for role in ("a", "b"):
        steps = sorted(r["attributes"]["relax.step"] for r in records if r["resource"]["relax.role"] == role)
        assert steps == list(range(n))


def test_a_truncated_last_line_is_skipped_but_a_bad_middle_line_is_an_error(tmp_path):
    path = tmp_path / "traces.jsonl"
    tel = Telemetry("actor", JsonlSpanExporter(path), batch=False)
    for step in range(2):
        with tel.span(TRAIN_STEP, step=step):
            pass
    tel.shutdown()
    good = path.read_text()
    path.write_text(good + '{"name": "relax.actor.tra')
    assert len(read_spans(path)) == 2
    path.write_text('{"name": \n' + good)
    with pytest.raises(ValueError, match=r"traces.jsonl:1 "):
        read_spans(path)


def test_the_spec_chooses_the_file(tmp_path):
    default = RunSpec(name="r", tracing={"exporter": "jsonl"}).tracing
    assert traces_path(default, tmp_path) == tmp_path / "traces.jsonl"
    relative = RunSpec(name="r", tracing={"exporter": "jsonl", "endpoint": "t/run.jsonl"}).tracing
    assert traces_path(relative, tmp_path) == tmp_path / "t" / "run.jsonl"
    absolute = RunSpec(name="r", tracing={"exporter": "jsonl", "endpoint": str(tmp_path / "x.jsonl")}).tracing
    assert traces_path(absolute, tmp_path / "out") == tmp_path / "x.jsonl"

    tel = Telemetry.from_spec(RunSpec(name="r", tracing={"exporter": "jsonl", "endpoint": "t/run.jsonl"}),
                              tmp_path, "reward")
    with tel.span("relax.reward.score", step=0):
        pass
    tel.shutdown()
    assert [r["name"] for r in read_spans(tmp_path / "t" / "run.jsonl")] == ["relax.reward.score"]


def test_console_exporter_prints_one_json_line_per_span(tmp_path, capfd):
    tel = Telemetry.from_spec(RunSpec(name="r", tracing={"exporter": "console"}), tmp_path, "advantage")
    with tel.span("relax.advantage.compute", step=1):
        pass
    tel.shutdown()
    (line,) = capfd.readouterr().out.splitlines()
    assert json.loads(line)["attributes"]["relax.step"] == 1
