"""Hugging Face exports (``trainer.export_every``) and the permissions of checkpoints and exports.

Pure tests drive ``save_checkpoint`` and ``export_model`` with a trainer whose ``save`` writes an HF
folder plus training state; one real run of the tiny preset (with the three built-in trackers on,
read back with their own readers) loads its exports with transformers."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from relax.runtime.checkpoint import export_model, save_checkpoint


class _Trainer:
    """A trainer whose ``save`` writes what the built-in ones write: model files, a tokenizer file,
    a sub-folder, and the training state an export must leave out."""

    def __init__(self) -> None:
        self.saves = 0

    def save(self, path: str) -> None:
        from relax_plugins.trainer.steps import atomic_folder

        self.saves += 1
        with atomic_folder(path) as staging:
            (staging / "config.json").write_text(json.dumps({"model_type": "fake", "save": self.saves}))
            (staging / "model.safetensors").write_bytes(b"weights")
            (staging / "tokenizer.json").write_text("{}")
            (staging / "extra").mkdir()
            (staging / "extra" / "note.txt").write_text("kept")
            (staging / "optimizer.pt").write_bytes(b"state")
            (staging / "trainer_state.json").write_text('{"version": 1}')


def _modes(folder: Path) -> set[tuple[str, int]]:
    found = {("dir", stat.S_IMODE(folder.stat().st_mode))}
    for parent, dirs, files in os.walk(folder):
        found |= {("dir", stat.S_IMODE(os.stat(os.path.join(parent, d)).st_mode)) for d in dirs}
        found |= {("file", stat.S_IMODE(os.stat(os.path.join(parent, f)).st_mode)) for f in files}
    return found


@pytest.fixture
def strict_umask():
    old = os.umask(0o077)  # what a locked-down login gives: nothing may stay at the umask's say
    try:
        yield
    finally:
        os.umask(old)


def test_checkpoints_and_exports_are_readable_by_others(tmp_path, strict_umask):
    trainer = _Trainer()
    checkpoint = save_checkpoint(tmp_path, 2, trainer, keep=2)
    assert _modes(checkpoint) == {("dir", 0o755), ("file", 0o644)}
    export = export_model(tmp_path, 2, trainer, checkpoint=checkpoint)
    assert export == tmp_path / "export" / "step-2"
    assert _modes(export) == {("dir", 0o755), ("file", 0o644)}


def test_an_export_links_the_checkpoint_of_its_step_without_training_state(tmp_path):
    trainer = _Trainer()
    checkpoint = save_checkpoint(tmp_path, 4, trainer, keep=2)
    export = export_model(tmp_path, 4, trainer, checkpoint=checkpoint)
    assert trainer.saves == 1  # no second save
    names = sorted(str(p.relative_to(export)) for p in export.rglob("*"))
    assert names == ["config.json", "extra", "extra/note.txt", "model.safetensors", "tokenizer.json"]
    assert os.path.samefile(export / "model.safetensors", checkpoint / "trainer" / "model.safetensors")
    assert not list((tmp_path / "export").glob(".*"))  # no staging folder left behind


def test_an_export_without_a_checkpoint_is_saved_by_the_trainer_and_replaces_an_older_one(tmp_path):
    trainer = _Trainer()
    export_model(tmp_path, 3, trainer)
    export = export_model(tmp_path, 3, trainer)
    assert trainer.saves == 2
    assert json.loads((export / "config.json").read_text())["save"] == 2
    assert not (export / "optimizer.pt").exists() and not (export / "trainer_state.json").exists()
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["step-3"]


def test_export_every_reaches_the_run_settings():
    from relax.testing import tiny_spec

    spec, plan, _ = tiny_spec(Path("/tmp/unused"), "e", "trainer.export_every=2")
    assert spec.trainer.export_every == 2 and plan.settings.export_every == 2
    _, plan, _ = tiny_spec(Path("/tmp/unused"), "e", "trainer.export_every=null")
    assert plan.settings.export_every == 0


# -- one real run: the trackers read back, the exports loaded with transformers -----------------

from tests.plugins.test_loggers import read_wandb_records  # noqa: E402


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def test_a_tiny_run_feeds_every_tracker_and_exports_loadable_models(tmp_path, loggers_registered, monkeypatch):
    import math

    import torch
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax.testing import local_ray, tiny_run

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with local_ray():
        code, rows, _ = tiny_run(tmp_path, "tracked", "logging=[{name: tensorboard}, {name: wandb}, {name: mlflow}]",
                                 "trainer.export_every=2", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=3")
    assert code == 0 and [r["step"] for r in rows] == [1, 2, 3]
    out = tmp_path / "tracked"
    numbers = {k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    texts = {k for r in rows for k, v in r.items() if isinstance(v, str)}

    def having(key):  # the rows that hold a number for key (a row may leave a key out, or hold null)
        return [r for r in rows if isinstance(r.get(key), (int, float))]
    assert {"reward/mean", "step", "data/order"} <= numbers | texts

    def same(a, b):
        return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6, abs=1e-9)

    # TensorBoard: every numeric key is a scalar series with each row's value at its step.
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert numbers <= set(events.Tags()["scalars"])
    for key in numbers:
        got = events.Scalars(key)
        assert [e.step for e in got] == [r["step"] for r in having(key)], key
        assert all(same(e.value, float(r[key])) for e, r in zip(got, having(key))), key
    assert {f"{k}/text_summary" for k in texts} <= set(events.Tags()["tensors"])

    # wandb: an offline run folder under the output folder, every key of every row in its history.
    [run_file] = (out / "wandb").glob("offline-run-*/run-*.wandb")
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in read_wandb_records(run_file) if r.WhichOneof("record_type") == "history"]
    assert [h["step"] for h in history] == [1, 2, 3]
    for got, row in zip(history, rows):
        for key in numbers & set(having_key := {k for k in row if isinstance(row[k], (int, float))}):
            assert key in got and (got[key] in ("NaN", "nan") if math.isnan(row[key]) else same(got[key], row[key])), key
        assert all(got[k] == row[k] for k in texts if isinstance(row.get(k), str))
        assert having_key <= set(got)

    # MLflow: the local store under the output folder, every numeric key's history.
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    [experiment] = [e for e in client.search_experiments() if e.name == "relax"]
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    for key in numbers:
        history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        assert [m.step for m in history] == [r["step"] for r in having(key)], key
        assert all(same(m.value, float(r[key])) for m, r in zip(history, having(key))), key

    # Exports at step 2 (export_every) and 3 (the end): load with transformers, equal the checkpoint.
    assert sorted(p.name for p in (out / "export").iterdir()) == ["step-2", "step-3"]
    weights = {}
    for step in (2, 3):
        export = out / "export" / f"step-{step}"
        assert _modes(export) == {("dir", 0o755), ("file", 0o644)}
        assert _modes(out / "checkpoints" / f"step-{step}") == {("dir", 0o755), ("file", 0o644)}
        assert not (export / "optimizer.pt").exists() and not (export / "trainer_state.json").exists()
        model = AutoModelForCausalLM.from_pretrained(export).eval()
        tokenizer = AutoTokenizer.from_pretrained(export)
        checkpoint = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / f"step-{step}" / "trainer").eval()
        ids = torch.tensor([tokenizer("12+34=")["input_ids"]])
        with torch.no_grad():
            assert torch.equal(model(ids).logits, checkpoint(ids).logits)
        weights[step] = _weights(export)
        assert all(torch.equal(v, _weights(out / "checkpoints" / f"step-{step}" / "trainer")[k])
                   for k, v in weights[step].items())
    assert any(not torch.equal(weights[2][k], weights[3][k]) for k in weights[2])  # it trained in between
