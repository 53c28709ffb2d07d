"""The built-in experiment trackers (``relax.loggers``): every key of a metrics row reaches each
one, read back with the tracker's own reader (TensorBoard's EventAccumulator, wandb's protobuf
records of its offline run file, MLflow's client on the local store); ``relax validate`` checks
``logging:`` entries; the driver's ``Trackers`` survives a logger that fails mid-run; and one
short real run of the tiny preset with all three on."""

from __future__ import annotations

import importlib
import math
import struct
import sys
import tomllib
from pathlib import Path

import pytest

from relax.contracts import PluginKind, RunInfo
from relax.registry import PluginEntry, check_contract
from relax_plugins.loggers.mlflow_runs import MlflowLogger
from relax_plugins.loggers.rows import split_row
from relax_plugins.loggers.tensorboard_events import TensorBoardLogger
from relax_plugins.loggers.wandb_runs import WandbLogger, wandb_mode

ROOT = Path(__file__).resolve().parents[2]
LOGGERS = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger, "mlflow": MlflowLogger}

#: Rows shaped like metrics.jsonl's: numbers, an int, a bool, the two string keys, a None.
ROWS = [
    {"step": 1, "reward/mean": 0.25, "loss": 1.5, "samples/produced": 8, "faults/restarts": 0,
     "data/order": "a1b2", "samples/trained_hash": "ffee01", "eval/skipped": None, "rollout/ok": True},
    {"step": 2, "reward/mean": 0.5, "loss": 1.25, "samples/produced": 16, "faults/restarts": 0,
     "data/order": "a1b2", "samples/trained_hash": "ffee02", "eval/skipped": None, "rollout/ok": False},
    {"step": 3, "reward/mean": 0.75, "loss": float("nan"), "samples/produced": 24, "faults/restarts": 1,
     "data/order": "a1b2", "samples/trained_hash": "ffee03", "eval/skipped": None, "rollout/ok": True},
]
SCALAR_KEYS = {"step", "reward/mean", "loss", "samples/produced", "faults/restarts", "rollout/ok"}
TEXT_KEYS = {"data/order", "samples/trained_hash"}


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b)


def _run_info(tmp_path: Path) -> RunInfo:
    return RunInfo(name="unit", output_dir=str(tmp_path), config={"name": "unit", "trainer": {"steps": 3}})


def _drive(logger, status="finished"):
    for row in ROWS:
        logger.log(row["step"], dict(row))
    logger.close(status)


# -- the contract and the row --------------------------------------------------------------------


def test_the_built_in_loggers_are_registered_and_match_the_contract():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["relax.loggers"]
    assert set(declared) == set(LOGGERS)
    for name, cls in LOGGERS.items():
        module, _, attr = declared[name].partition(":")
        assert getattr(importlib.import_module(module), attr) is cls
        check_contract(PluginKind.loggers, PluginEntry(PluginKind.loggers, name, declared[name], "relax", "test"), cls)


def test_a_row_splits_into_scalars_and_text_and_none_is_left_out():
    scalars, texts = split_row({**ROWS[0], "nested": {"b": 1, "a": [1, 2]}})
    assert set(scalars) == SCALAR_KEYS and scalars["rollout/ok"] == 1.0 and scalars["samples/produced"] == 8.0
    assert texts == {"data/order": "a1b2", "samples/trained_hash": "ffee01", "nested": '{"a": [1, 2], "b": 1}'}


def test_the_logger_modules_import_no_tracker_library():
    code = ("import sys, relax_plugins.loggers.tensorboard_events, relax_plugins.loggers.wandb_runs, "
            "relax_plugins.loggers.mlflow_runs; "
            "print(sorted(m for m in ('torch', 'tensorboard', 'wandb', 'mlflow') if m in sys.modules))")
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "[]"


# -- each tracker, read back with its own reader -------------------------------------------------


def test_tensorboard_event_file_holds_every_scalar_and_the_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(TensorBoardLogger.Config(), _run_info(tmp_path))
    _drive(logger)
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert set(events.Tags()["scalars"]) == SCALAR_KEYS
    for key in SCALAR_KEYS:
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in got] == [1, 2, 3]
        assert all(_same(v, float(row[key])) for (_, v), row in zip(got, ROWS)), key
    texts = set(events.Tags()["tensors"])
    assert {"data/order/text_summary", "samples/trained_hash/text_summary", "config/text_summary"} <= texts
    hashes = [e.tensor_proto.string_val[0].decode() for e in events.Tensors("samples/trained_hash/text_summary")]
    assert hashes == ["ffee01", "ffee02", "ffee03"]


def read_wandb_records(path: Path) -> list:
    """The protobuf records of a wandb run file (``run-<id>.wandb``), parsed with wandb's own
    ``Record`` message. The file is wandb's transaction log: a 7-byte header (``:W&B``, magic
    0xBEE1, version 0) and then records in 32 KiB blocks, each chunk with a 7-byte header (CRC32,
    little-endian length, type: 1 full, 2 first, 3 middle, 4 last); a block's tail shorter than
    a header is padding."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, "not a wandb run file"
    block, pos, records, parts = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # padding at the end of a block
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        parts += chunk
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def test_wandb_offline_run_holds_every_key_at_its_step(tmp_path, monkeypatch):
    import json

    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_mode(None) == "offline" and wandb_mode("online") == "online"
    logger = WandbLogger(WandbLogger.Config(), _run_info(tmp_path))
    assert logger.mode == "offline"
    _drive(logger)
    [run_file] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = read_wandb_records(run_file)
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert len(history) == 3
    for got, row in zip(history, ROWS):
        for key in SCALAR_KEYS | TEXT_KEYS:
            want = row[key]
            value = got[key]
            if isinstance(want, str):
                assert value == want
            elif isinstance(want, float) and math.isnan(want):
                assert value in ("NaN", "nan") or (isinstance(value, float) and math.isnan(value))
            else:
                assert value == pytest.approx(float(want)), key
        assert "eval/skipped" not in got
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "unit"
    assert {item.key: json.loads(item.value_json) for item in run.config.update}["trainer"] == {"steps": 3}


def test_mlflow_local_store_holds_every_metric_and_the_text_as_tags(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    logger = MlflowLogger(MlflowLogger.Config(), _run_info(tmp_path))
    assert logger.tracking_uri == (tmp_path / "mlruns").resolve().as_uri()
    _drive(logger, status="failed")
    client = MlflowClient(tracking_uri=logger.tracking_uri)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FAILED" and run.info.run_name == "unit"
    for key in SCALAR_KEYS:
        history = sorted(client.get_metric_history(logger.run_id, key), key=lambda m: m.step)
        assert [m.step for m in history] == [1, 2, 3]
        assert all(_same(m.value, float(row[key])) for m, row in zip(history, ROWS)), key
    assert run.data.tags["samples/trained_hash"] == "ffee03" and run.data.tags["data/order"] == "a1b2"
    assert run.data.params["trainer.steps"] == "3" and run.data.params["name"] == "unit"


# -- the driver's side ----------------------------------------------------------------------------


class _Recorder:
    def __init__(self, fail_at: int | None = None) -> None:
        self.rows, self.closed, self.fail_at = [], [], fail_at

    def log(self, step, metrics):
        if step == self.fail_at:
            raise OSError("disk full")
        self.rows.append((step, metrics))

    def close(self, status):
        self.closed.append(status)


def test_trackers_hand_every_row_on_and_drop_a_logger_that_fails_midway():
    import io

    from relax.runtime.driver.trackers import Trackers

    good, bad, out = _Recorder(), _Recorder(fail_at=2), io.StringIO()
    trackers = Trackers([("logging[0] ('good')", good), ("logging[1] ('bad')", bad)], stream=out)
    for row in ROWS:
        trackers.log(row)
    trackers.close("finished")
    trackers.close("failed")  # once only
    assert [s for s, _ in good.rows] == [1, 2, 3] and good.rows[0][1] == ROWS[0]
    assert [s for s, _ in bad.rows] == [1] and bad.closed == ["failed"] and good.closed == ["finished"]
    assert "logging[1] ('bad') failed at step 2" in out.getvalue() and "disk full" in out.getvalue()


def test_a_logger_that_cannot_start_names_its_entry(tmp_path, loggers_registered):
    from relax.runtime.driver.trackers import TrackerStartError, Trackers
    from relax.testing import tiny_spec

    spec, _, _ = tiny_spec(tmp_path, "bad-logger", "logging=[{name: tensorboard}, {name: mlflow, options: "
                           "{tracking_uri: 'nosuchscheme://x'}}]")
    with pytest.raises(TrackerStartError, match=r"logging\[1\] \('mlflow'\) could not start"):
        Trackers.from_spec(spec, tmp_path)


# -- relax validate ------------------------------------------------------------------------------


def test_validate_checks_logger_names_and_options(tmp_path, loggers_registered):
    from relax.config import load_spec_dict
    from relax.spec import validate_spec
    from relax.errors import SpecError

    raw, base = load_spec_dict("tiny-cpu", [
        "logging=[{name: tensorbord}, {name: wandb, options: {mode: loud}}, {name: mlflow}]"])
    with pytest.raises(SpecError) as caught:
        validate_spec(raw, base_dir=base)
    issues = {i.path: i for i in caught.value.issues}
    assert set(issues) == {"logging[0].name", "logging[1].options.mode"}
    assert "did you mean" in issues["logging[0].name"].remedy and "tensorboard" in issues["logging[0].name"].remedy
    raw, base = load_spec_dict("tiny-cpu", ["logging=[{name: tensorboard, options: {log_dir: tb}}, {name: wandb}]"])
    spec = validate_spec(raw, base_dir=base)
    assert [(e.name, e.options) for e in spec.logging] == [("tensorboard", {"log_dir": "tb"}), ("wandb", {})]
