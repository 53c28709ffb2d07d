"""Samples of a real run: a tiny run with every tracker on leaves its sampled rows in
samples.jsonl, each tracker holds them (read back with its own reader: TensorBoard's
EventAccumulator, the wandb offline run's table file, MLflow's client on its file store),
``relax samples`` prints them, the progress lines show one per sampled step, and every metrics row
has the health figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

#: The figures every metrics.jsonl row has, whatever the run.
HEALTH_KEYS = ("response_length/mean", "response_length/max", "response_length/clip_frac", "reward/std",
               "reward/min", "reward/max", "entropy", "prompt_length/mean")
#: The keys of a plain (not agentic) sample row.
ROW_KEYS = {"step", "sample_id", "policy_version", "prompt", "response", "label", "response_tokens", "reward",
            "reward/exact_match"}


def check_health_figures(rows: list[dict]) -> None:
    """Every row has every health figure, each within its range."""
    for row in rows:
        missing = [k for k in HEALTH_KEYS if k not in row]
        assert not missing, (row["step"], missing)
        assert 0 < row["response_length/mean"] <= row["response_length/max"]
        assert 0.0 <= row["response_length/clip_frac"] <= 1.0
        assert row["prompt_length/mean"] > 0
        assert row["reward/min"] <= row["reward/mean"] <= row["reward/max"] and row["reward/std"] >= 0
        assert row["entropy"] is not None and row["entropy"] > 0
        assert row["train/loss"] is not None  # the train/* keys stay


def test_a_tiny_run_writes_its_samples_to_the_file_every_tracker_and_the_console(tmp_path, loggers_registered,
                                                                                 monkeypatch, capsys):
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from relax.cli import main
    from relax.testing import local_ray, tiny_run

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with local_ray():
        code, rows, printed = tiny_run(tmp_path, "sampled", "trainer.steps=4", "trainer.log_samples_every=2",
                                       "trainer.log_samples=3",
                                       "logging=[{name: tensorboard}, {name: wandb}, {name: mlflow}]")
    assert code == 0 and [r["step"] for r in rows] == [1, 2, 3, 4]
    check_health_figures(rows)
    out = tmp_path / "sampled"

    # samples.jsonl: three rows of steps 2 and 4, each with its texts, rewards and version
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [2, 2, 2, 4, 4, 4]
    by_step = {step: [s for s in samples if s["step"] == step] for step in (2, 4)}
    for step, kept in by_step.items():
        row = rows[step - 1]
        for sample in kept:
            assert set(sample) == ROW_KEYS
            assert sample["prompt"] and isinstance(sample["response"], str) and sample["label"]
            assert sample["sample_id"].startswith(f"{step - 1}:")
            assert sample["policy_version"] <= step - 1
            assert sample["reward"] == sample["reward/exact_match"]
            assert row["reward/min"] <= sample["reward"] <= row["reward/max"]
        rewards = [s["reward"] for s in kept]
        assert max(rewards) == row["reward/max"] and min(rewards) == row["reward/min"]  # the best and the worst

    # the console: one sample line per sampled step, after its step's line
    lines = printed.splitlines()
    sample_lines = [i for i, line in enumerate(lines) if ": sample reward " in line]
    assert [lines[i].split(":")[0] for i in sample_lines] == ["[relax] step 2", "[relax] step 4"]
    assert all(lines[i - 1].startswith(f"[relax] step {s}/4") for i, s in zip(sample_lines, (2, 4)))

    # TensorBoard: the text summary "samples" at steps 2 and 4, holding each row's prompt and response
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("samples/text_summary")
    assert [e.step for e in texts] == [2, 4]
    for event, step in zip(texts, (2, 4)):
        markdown = event.tensor_proto.string_val[0].decode()
        assert markdown.count(f"### step {step}, sample ") == 3
        assert all(s["prompt"] in markdown and s["response"] in markdown for s in by_step[step])

    # wandb: the table "samples", written by the offline run at each sampled step
    [run_dir] = (out / "wandb").glob("offline-run-*")
    tables = sorted(run_dir.glob("files/media/table/samples_*.table.json"),
                    key=lambda p: int(p.name.split("_")[1]))
    assert len(tables) == 2
    for path, step in zip(tables, (2, 4)):
        table = json.loads(path.read_text())
        got = [dict(zip(table["columns"], values)) for values in table["data"]]
        assert got == by_step[step]

    # MLflow: one JSON artifact per sampled step, through the client on the file store
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    [experiment] = [e for e in client.search_experiments() if e.name == "relax"]
    [run] = client.search_runs([experiment.experiment_id])
    listed = sorted(a.path for a in client.list_artifacts(run.info.run_id, "samples"))
    assert listed == ["samples/step-2.json", "samples/step-4.json"]
    for step in (2, 4):
        local = client.download_artifacts(run.info.run_id, f"samples/step-{step}.json", str(tmp_path))
        assert json.loads(Path(local).read_text()) == {"step": step, "rows": by_step[step]}

    # relax samples reads them back
    capsys.readouterr()
    assert main(["samples", str(out), "--worst", "2"]) == 0
    shown = capsys.readouterr().out
    worst = sorted(samples, key=lambda s: (s["reward"], s["step"]))[:2]
    assert shown.count("\n\nstep ") == 1 and shown.startswith(f"step {worst[0]['step']}  sample {worst[0]['sample_id']}")
    assert f"sample {worst[1]['sample_id']}" in shown
