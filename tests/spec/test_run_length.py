"""``trainer.epochs``: resolved to steps from the training set's size before anything is built
(data files counted, synthetic sets by their ``length``), carried by the plan, and refused with a
remedy when given with ``trainer.steps`` or when the size cannot be known. Also the learning-rate
schedule's spec fields."""

from __future__ import annotations

import json

import pytest

from relax.config import load_spec_dict
from relax.plan import make_plan, render
from relax.spec import SpecError, validate_spec
from relax.spec.data_files import data_rows
from relax.spec.run_length import run_steps, steps_for_epochs


def _plan(*overrides: str, base_dir=None):
    raw, base = load_spec_dict("tiny-cpu", list(overrides))
    spec = validate_spec(raw, base_dir=base_dir or base)
    return spec, make_plan(spec, base_dir=base_dir or base)


def test_epochs_resolve_to_steps_from_the_synthetic_sets_size() -> None:
    # 4096 problems, 16 prompts a step: half an epoch is 128 steps.
    spec, plan = _plan("trainer.steps=null", "trainer.epochs=0.5")
    assert spec.trainer.steps is None and spec.trainer.epochs == 0.5
    assert plan.settings.steps == 128 and plan.settings.epochs == 0.5
    assert "Run: 128 training step(s) (trainer.epochs=0.5" in render(plan, "table")
    actor = next(p for w in plan.workers for loop in w.roles for p in loop.plugins
                 if p.kind == "trainer" and loop.role == "actor")
    assert actor.context["total_steps"] == 128  # the trainer's schedule spans the resolved run
    _, small = _plan("trainer.steps=null", "trainer.epochs=1", "data.train.options.size=40")
    assert small.settings.steps == 3  # ceil(40 / 16): the last step reaches into the next pass


def test_steps_still_come_from_trainer_steps() -> None:
    spec, plan = _plan()
    assert run_steps(spec) == 60 and plan.settings.steps == 60 and plan.settings.epochs is None


def test_epochs_of_a_data_file_count_its_rows_and_its_limit(tmp_path) -> None:
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(50)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    overrides = ("trainer.steps=null", "trainer.epochs=2", "data.train.source=train.jsonl")
    _, plan = _plan(*overrides, base_dir=tmp_path)
    assert plan.settings.steps == 7  # ceil(2 * 50 / 16)
    _, limited = _plan(*overrides, "+data.train.options.limit=20", base_dir=tmp_path)
    assert limited.settings.steps == 3  # ceil(2 * 20 / 16)


def test_data_rows_counts_each_file_format(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.json").write_text(json.dumps([{"prompt": "x"}] * 5))
    (tmp_path / "a.csv").write_text('prompt,answer\n"1+1=\nwith a newline",2\n\n3+4=,7\n')
    table = pa.table({"prompt": ["a", "b", "c"]})
    pq.write_table(table, tmp_path / "a.parquet")
    with pa.OSFile(str(tmp_path / "a.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
        writer.write_table(table)
    assert data_rows(tmp_path / "a.json") == 5
    assert data_rows(tmp_path / "a.csv") == 2  # a quoted newline is one record; blank lines are none
    assert data_rows(tmp_path / "a.parquet") == 3
    assert data_rows(tmp_path / "a.arrow") == 6
    (tmp_path / "bad.json").write_text("{not json")
    assert data_rows(tmp_path / "bad.json") is None


def test_a_saved_dataset_folder_counts_its_split(tmp_path) -> None:
    import datasets

    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["a"] * 7}),
                          "test": datasets.Dataset.from_dict({"prompt": ["b"] * 2})}).save_to_disk(str(folder))
    assert data_rows(folder) == 7
    assert data_rows(folder, "test") == 2


def test_steps_for_epochs_rounds_up_but_not_on_float_noise() -> None:
    assert steps_for_epochs(1.0, 64, 16) == 4
    assert steps_for_epochs(0.3, 160, 16) == 3  # 0.3 * 160 / 16 = 3.0000000000000004 in floats
    assert steps_for_epochs(1.0, 65, 16) == 5
    assert steps_for_epochs(0.001, 10, 16) == 1


def test_steps_and_epochs_together_are_refused_naming_both(check, cpu_spec) -> None:
    cpu_spec["trainer"] = {"steps": 10, "epochs": 2}
    issue = check(cpu_spec)["trainer"]
    assert "trainer.steps=10" in issue.message and "trainer.epochs=2" in issue.message
    assert "remove trainer.steps" in issue.message and "null" in issue.message
    cpu_spec["trainer"] = {"steps": None}
    assert "give trainer.steps" in check(cpu_spec)["trainer"].message


def test_epochs_of_a_data_set_of_unknown_size_are_refused(check, cpu_spec) -> None:
    # The testkit's test_prompts declares no length(config).
    cpu_spec["trainer"] = {"epochs": 1}
    issue = check(cpu_spec)["trainer.epochs"]
    assert "test_prompts" in issue.message and "length(config)" in issue.message
    assert "trainer.steps" in issue.remedy


def test_epochs_of_a_missing_data_file_name_the_file(check, cpu_spec) -> None:
    cpu_spec["trainer"] = {"epochs": 1}
    cpu_spec["data"] = {"train": {"source": "nowhere.jsonl"}}
    issues = check(cpu_spec)
    assert "nowhere.jsonl does not exist" in issues["trainer.epochs"].message


def test_plan_refuses_unknown_epochs_too(testkit_registry, cpu_spec, tmp_path) -> None:
    from relax.spec.models import RunSpec

    cpu_spec["trainer"] = {"epochs": 1}
    with pytest.raises(SpecError, match="trainer.epochs"):
        run_steps(RunSpec.model_validate(cpu_spec), tmp_path, testkit_registry)


def test_lr_schedule_fields_are_checked(check, cpu_spec) -> None:
    optimizer = {"lr_schedule": "cosine", "warmup_steps": 3, "warmup_ratio": 0.1}
    cpu_spec["roles"]["actor"]["optimizer"] = optimizer
    issue = check(cpu_spec)["roles.actor.optimizer"]
    assert "warmup_steps=3 and warmup_ratio=0.1 are both set" in issue.message
    cpu_spec["roles"]["actor"]["optimizer"] = {"lr_schedule": "step"}
    assert "one of: constant, linear, cosine" in str(check(cpu_spec)["roles.actor.optimizer.lr_schedule"])
    cpu_spec["roles"]["actor"]["optimizer"] = {"min_lr_ratio": 1.5}
    assert "roles.actor.optimizer.min_lr_ratio" in check(cpu_spec)
    cpu_spec["roles"]["actor"]["optimizer"] = {"warmup_steps": 100}
    cpu_spec["trainer"] = {"steps": 100}
    issue = check(cpu_spec)["roles.actor.optimizer.warmup_steps"]
    assert "the run has 100 steps" in issue.message
    cpu_spec["roles"]["actor"]["optimizer"] = {"warmup_ratio": 0.1, "lr_schedule": "linear", "min_lr_ratio": 0.1}
    assert check(cpu_spec) == {}


def test_sampling_stop_and_repetition_penalty_are_checked(check, cpu_spec) -> None:
    cpu_spec["roles"]["rollout"]["sampling"] = {"stop": ["</answer>", ""]}
    assert "empty stop string" in check(cpu_spec)["roles.rollout.sampling.stop"].message
    cpu_spec["roles"]["rollout"]["sampling"] = {"repetition_penalty": 0}
    assert "roles.rollout.sampling.repetition_penalty" in check(cpu_spec)
    cpu_spec["roles"]["rollout"]["sampling"] = {"stop": ["\n\n"], "repetition_penalty": 1.1}
    assert check(cpu_spec) == {}
