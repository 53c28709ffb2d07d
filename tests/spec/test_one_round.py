"""One validation round reports every problem: shape, plugin names and options, cross-field rules
and data columns together; a rule reading a broken field is skipped (tests/spec/test_field_by_field.py
has more); the checks ``relax run`` makes before it starts (today's runtime, this machine's GPUs)
are rules too, the machine's a note in a plain ``relax validate``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.cli import main
from relax.spec import SpecError, validate_spec
from relax.spec import machine
from relax.spec.rules import RULES, RUNTIME_RULES, Rule, rule

FIVE_MISTAKES = """\
name: five
trainer: {steps: -1}
rewards: [{name: exact_macth}]
algorithm: {kl_coef: 0.1}
data: {train: {source: prompts.jsonl}, prompt_key: promt}
roles: {rollout: {options: {bogus: 1}}}
"""
FIVE_PATHS = {"trainer.steps", "rewards[0].name", "algorithm.kl_coef", "data.prompt_key",
              "roles.rollout.options.bogus"}


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_five_mistakes_of_five_kinds_in_one_validate_call(tmp_path, capsys, monkeypatch):
    write_rows(tmp_path / "prompts.jsonl", [{"prompt": "1+1=", "answer": "2"}] * 3)
    (tmp_path / "five.yaml").write_text(FIVE_MISTAKES)
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "five.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("5 problems in the run spec:")
    for path in FIVE_PATHS:
        assert f"  - {path}: " in err, path
    assert "did you mean 'exact_match'?" in err and "did you mean 'prompt'?" in err


def test_a_shape_error_does_not_hide_an_unknown_algorithm():
    with pytest.raises(SpecError) as exc:
        validate_spec({"name": "x", "seed": -1, "algorithm": {"name": "grop"}})
    assert {i.path for i in exc.value.issues} == {"seed", "algorithm.name"}


# --- rules reading broken fields are skipped -------------------------------------------------------


def test_a_rule_reading_a_broken_field_is_skipped(check, cpu_spec):
    # kl_coef without a reference is check_algorithm's: a broken actor is no reason to skip it ...
    cpu_spec["algorithm"]["kl_coef"] = 0.1
    cpu_spec["roles"]["actor"]["gpus"] = -1
    assert set(check(cpu_spec)) == {"roles.actor.gpus", "algorithm.kl_coef"}
    # ... but a broken reference is: with its default (none) the rule would judge what is not there
    cpu_spec["roles"]["actor"]["gpus"] = 0
    cpu_spec["roles"]["reference"] = {"backend": "test_trainer", "gpus": -1}
    assert set(check(cpu_spec)) == {"roles.reference.gpus"}


def test_a_rule_reading_sound_sections_reports_beside_a_shape_error(check, cpu_spec):
    cpu_spec["algorithm"]["kl_coef"] = 0.1
    cpu_spec["trainer"] = {"steps": -1}
    assert set(check(cpu_spec)) == {"trainer.steps", "algorithm.kl_coef"}


def test_rules_declare_only_spec_sections():
    for each in (*RULES, *RUNTIME_RULES, *machine.MACHINE_RULES):
        assert isinstance(each, Rule) and each.reads, each
    with pytest.raises(ValueError, match="not RunSpec sections"):
        rule("rolez")(lambda spec, ctx: ())


# --- the checks relax run made alone (runtime rules) ----------------------------------------------


@pytest.fixture
def check_runnable(testkit_registry, tmp_path, monkeypatch):
    """Issues by path of ``validate_spec(..., runnable=True)`` on a machine with 8 GPUs (``here``:
    judging this machine too, as ``relax run`` and ``relax validate --here`` do), whose Hugging Face
    cache holds the spec's model."""
    monkeypatch.setattr(machine, "local_gpu_count", lambda: 8)
    held = tmp_path / "snapshot"
    held.mkdir()
    (held / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(machine, "cached_snapshot", lambda path: held)

    def run(raw: dict, here: bool = True) -> dict:
        try:
            validate_spec(raw, base_dir=tmp_path, registry=testkit_registry, runnable=True, here=here)
        except SpecError as exc:
            return {i.path: i for i in exc.issues}
        return {}

    return run


def test_colocate_runs_one_rollout_replica(check, check_runnable, gpu_spec):
    gpu_spec["placement"] = {"mode": "colocate"}
    gpu_spec["async_policy"] = {"max_staleness": 0}
    gpu_spec["roles"]["rollout"]["replicas"] = 2  # 2 x 2 GPUs = the actor's 4: the spec means something
    assert check(gpu_spec) == {}
    issues = check_runnable(gpu_spec)
    assert set(issues) == {"roles.rollout.replicas"}
    assert "inside the actor's process" in issues["roles.rollout.replicas"].message
    assert "replicas: 1 and gpus_per_replica: 4" in issues["roles.rollout.replicas"].remedy
    gpu_spec["roles"]["rollout"] = {"backend": "test_rollout", "gpus_per_replica": 4, "parallel": {"tp": 4}}
    assert check_runnable(gpu_spec) == {}


@pytest.mark.parametrize("role", ["reward", "advantage"])
def test_reward_and_advantage_run_one_worker(check, check_runnable, cpu_spec, role):
    cpu_spec["roles"][role] = {"replicas": 2, **({"host": "own"} if role == "reward" else {})}
    assert check(cpu_spec) == {}  # the planner lays out two
    issues = check_runnable(cpu_spec)
    assert set(issues) == {f"roles.{role}.replicas"}
    assert issues[f"roles.{role}.replicas"].remedy == "set it to 1"


def test_actor_fwd_in_separate_mode_needs_load_weights(check_runnable, cpu_spec):
    cpu_spec["roles"]["actor_fwd"] = {"backend": "test_trainer"}  # the testkit trainer has no load_weights
    issues = check_runnable(cpu_spec)
    assert set(issues) == {"roles.actor_fwd.backend"}
    assert "load_weights" in issues["roles.actor_fwd.backend"].message
    cpu_spec["placement"] = {"mode": "hybrid"}  # actor_fwd shares the actor's process there
    assert check_runnable(cpu_spec) == {}


# --- this machine -------------------------------------------------------------------------------


def test_an_embedded_gpu_run_needs_the_gpus_here(check_runnable, gpu_spec, monkeypatch):
    assert check_runnable(gpu_spec) == {}  # 6 GPUs asked, 8 here
    monkeypatch.setattr(machine, "local_gpu_count", lambda: 2)
    issues = check_runnable(gpu_spec)
    assert set(issues) == {"cluster.address"}
    assert "asks for 6 GPUs on this machine" in issues["cluster.address"].message
    assert "which has 2" in issues["cluster.address"].message
    assert "set cluster.address" in issues["cluster.address"].remedy
    assert check_runnable(gpu_spec, here=False) == {}  # relax validate: the spec is sound
    gpu_spec["cluster"]["address"] = "ray://head:10001"  # a cluster elsewhere: not this machine's business
    assert check_runnable(gpu_spec) == {}


def test_machine_notes_name_what_this_machine_lacks(gpu_spec, testkit_registry, tmp_path, monkeypatch):
    from relax.spec.validate import machine_notes

    spec = validate_spec(gpu_spec, base_dir=tmp_path, registry=testkit_registry, runnable=True, here=False)
    monkeypatch.setattr(machine, "local_gpu_count", lambda: 2)
    monkeypatch.setattr(machine, "cached_snapshot", lambda path: None)  # an empty Hugging Face cache
    notes = machine_notes(spec, registry=testkit_registry)
    assert [n.path for n in notes] == ["cluster.address", "model.path"] and "which has 2" in notes[0].message
    assert "not in this machine's Hugging Face cache" in notes[1].message
    monkeypatch.setattr(machine, "local_gpu_count", lambda: 6)
    held = tmp_path / "snapshot"
    held.mkdir()
    (held / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(machine, "cached_snapshot", lambda path: held)
    assert machine_notes(spec, registry=testkit_registry) == []


def test_the_machine_check_is_not_part_of_a_plain_validation(check, gpu_spec, monkeypatch):
    monkeypatch.setattr(machine, "local_gpu_count", lambda: 0)
    assert check(gpu_spec) == {}  # relax plan shows a GPU spec's layout on any machine


def test_local_gpu_count_reads_the_driver_and_cuda_visible_devices(tmp_path, monkeypatch):
    gpus = tmp_path / "gpus"
    for bus_id in ("0000:01:00.0", "0000:41:00.0", "0000:81:00.0"):
        (gpus / bus_id).mkdir(parents=True)
    assert machine.local_gpu_count(gpus, env={}) == 3
    assert machine.local_gpu_count(gpus, env={"CUDA_VISIBLE_DEVICES": "0,2"}) == 2
    assert machine.local_gpu_count(gpus, env={"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert machine.local_gpu_count(gpus, env={"CUDA_VISIBLE_DEVICES": "1,-1,0"}) == 1
    assert machine.local_gpu_count(gpus, env={"CUDA_VISIBLE_DEVICES": "0,1,2,3,4"}) == 3
    monkeypatch.setenv("PATH", str(tmp_path))  # neither the driver's folder nor nvidia-smi
    assert machine.local_gpu_count(tmp_path / "absent", env={}) == 0


def test_local_gpu_count_falls_back_to_nvidia_smi(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-a)'\necho 'GPU 1: NVIDIA H200 (UUID: GPU-b)'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert machine.local_gpu_count(tmp_path / "absent", env={}) == 2


# --- data columns ---------------------------------------------------------------------------------


def data_spec(cpu_spec: dict, source: str, **data) -> dict:
    cpu_spec["data"] = {"train": {"source": source}, **data}
    return cpu_spec


def test_a_misnamed_prompt_column_names_the_columns_found(check, cpu_spec, tmp_path):
    write_rows(tmp_path / "p.jsonl", [{"question": "1+1=", "answer": "2"}])
    issues = check(data_spec(cpu_spec, "p.jsonl"))
    assert set(issues) == {"data.prompt_key"}
    assert "'prompt' is not a column" in issues["data.prompt_key"].message
    assert "answer, question" in issues["data.prompt_key"].message


def test_label_reward_and_media_columns_are_checked(check, cpu_spec, tmp_path):
    write_rows(tmp_path / "p.jsonl", [{"prompt": "q", "answer": "a", "source": "math", "images": []}])
    raw = data_spec(cpu_spec, "p.jsonl", label_key="anwser", reward_key="sourse", media_keys={"image": "imgs"})
    raw["model"]["modalities"] = ["text", "image"]
    issues = check(raw)
    # model.modalities: the testkit model reads text only (check_modalities), beside the three columns
    assert set(issues) == {"data.label_key", "data.reward_key", "data.media_keys.image", "model.modalities"}
    assert "did you mean 'answer'?" in issues["data.label_key"].remedy
    assert "did you mean 'source'?" in issues["data.reward_key"].remedy
    assert "did you mean 'images'?" in issues["data.media_keys.image"].remedy


def test_every_row_read_needs_a_prompt(check, cpu_spec, tmp_path):
    write_rows(tmp_path / "p.jsonl", [{"prompt": "q", "answer": "a"}, {"answer": "b"}])
    issues = check(data_spec(cpu_spec, "p.jsonl"))
    assert set(issues) == {"data.prompt_key"}
    assert "row 1 of p.jsonl has no 'prompt'" in issues["data.prompt_key"].message


def test_a_malformed_line_is_reported_with_its_number(check, cpu_spec, tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "q", "answer": "a"}\n\n{"prompt": "r", answer}\n')
    issues = check(data_spec(cpu_spec, "p.jsonl"))
    assert set(issues) == {"data.train.source"}
    assert "line 3 is not valid JSON" in issues["data.train.source"].message


def test_a_json_list_file_is_read_as_the_run_reads_it(check, cpu_spec, tmp_path):
    (tmp_path / "p.json").write_text(json.dumps([{"prompt": "q", "answer": "a"}]))
    assert check(data_spec(cpu_spec, "p.json")) == {}
    (tmp_path / "p.json").write_text('[{"prompt": "q",\n "answer": }]')
    issues = check(data_spec(cpu_spec, "p.json"))
    assert set(issues) == {"data.train.source"} and "line 2" in issues["data.train.source"].message


def test_only_rows_past_the_first_ones_are_left_to_the_run(check, cpu_spec, tmp_path):
    from relax.spec.rules import DATA_ROWS_CHECKED

    rows = [{"prompt": "q", "answer": "a"}] * DATA_ROWS_CHECKED + [{"answer": "b"}]
    write_rows(tmp_path / "p.jsonl", rows)
    assert check(data_spec(cpu_spec, "p.jsonl")) == {}


def test_eval_data_is_checked_too(check, cpu_spec, tmp_path):
    write_rows(tmp_path / "e.jsonl", [{"text": "q", "answer": "a"}])
    cpu_spec["data"] = {"eval": {"source": "e.jsonl"}}
    issues = check(cpu_spec)
    assert set(issues) == {"data.prompt_key"} and "e.jsonl" in issues["data.prompt_key"].message


@pytest.mark.parametrize(("source", "columns"), [
    ("synthetic:arithmetic", {"prompt", "answer"}),
    ("synthetic:omni", {"prompt", "answer", "kind", "image", "audio", "video"}),
])
def test_dataset_plugins_declare_their_columns(source, columns):
    from relax.contracts import PluginKind
    from relax.registry import get_registry

    assert set(get_registry().load(PluginKind.datasets, source).columns) == columns


def test_a_plugin_data_set_is_checked_against_its_declared_columns():
    with pytest.raises(SpecError) as exc:
        validate_spec({"name": "x", "data": {"prompt_key": "question"}})  # synthetic:arithmetic by default
    issue = next(i for i in exc.value.issues)
    assert issue.path == "data.prompt_key" and "data set 'synthetic:arithmetic'" in issue.message
    assert "answer, prompt" in issue.message


def test_a_data_set_without_labels_is_valid(check, cpu_spec, tmp_path):
    # format or judge rewards need no label: rows without any label column get None
    write_rows(tmp_path / "unlabelled.jsonl", [{"prompt": "say hi"}] * 3)
    raw = data_spec(cpu_spec, "unlabelled.jsonl")
    assert check(raw) == {}
