"""The spec loader: files, ``extends:``, ``${...}`` interpolation and dotted overrides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from relax.config import load_spec_dict
from relax.config.loader import PRESETS_DIR, PRESETS_ENV
from relax.spec import SpecError

TINY = yaml.safe_load((PRESETS_DIR / "tiny-cpu.yaml").read_text())


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def load_error(ref, overrides=()) -> SpecError:
    with pytest.raises(SpecError) as caught:
        load_spec_dict(ref, overrides)
    return caught.value


def test_extends_a_preset_by_name(tmp_path):
    spec = write(tmp_path / "run.yaml", "extends: tiny-cpu\nname: mine\nalgorithm: {kl_coef: 0.5}\n")
    raw, base_dir = load_spec_dict(spec)
    assert raw["name"] == "mine"
    assert raw["algorithm"]["kl_coef"] == 0.5
    assert raw["algorithm"]["samples_per_prompt"] == TINY["algorithm"]["samples_per_prompt"]
    assert raw["rewards"] == TINY["rewards"]
    assert base_dir == tmp_path.resolve()


def test_extends_a_preset_from_the_presets_path_env(tmp_path, monkeypatch):
    presets = tmp_path / "my-presets"
    presets.mkdir()
    write(presets / "house.yaml", "name: house\nseed: 7\n")
    monkeypatch.setenv(PRESETS_ENV, str(presets))
    raw, _ = load_spec_dict(write(tmp_path / "run.yaml", "extends: house\nname: run\n"))
    assert (raw["name"], raw["seed"]) == ("run", 7)


def test_extends_a_relative_path(tmp_path):
    (tmp_path / "base").mkdir()
    write(tmp_path / "base" / "common.yaml", "name: common\nseed: 3\ncluster: {nodes: 2}\n")
    (tmp_path / "runs").mkdir()
    spec = write(tmp_path / "runs" / "run.yaml", "extends: ../base/common.yaml\nname: run\ncluster: {gpus_per_node: 8}\n")
    raw, _ = load_spec_dict(spec)
    assert raw["seed"] == 3
    assert raw["cluster"] == {"nodes": 2, "gpus_per_node": 8}  # mappings merge key by key


def test_interpolation_in_a_parent_sees_the_child_value(tmp_path):
    write(tmp_path / "base.yaml", "name: base\ntrainer:\n  output_dir: runs/${name}\n")
    raw, _ = load_spec_dict(write(tmp_path / "child.yaml", "extends: base.yaml\nname: child\n"))
    assert raw["trainer"]["output_dir"] == "runs/child"


def test_extends_chain_of_three(tmp_path):
    write(tmp_path / "a.yaml", "name: a\nseed: 1\n")
    write(tmp_path / "b.yaml", "extends: a.yaml\nseed: 2\nmodel: {dtype: bfloat16}\n")
    raw, _ = load_spec_dict(write(tmp_path / "c.yaml", "extends: b.yaml\nname: c\n"))
    assert (raw["name"], raw["seed"], raw["model"]["dtype"]) == ("c", 2, "bfloat16")


def test_extends_cycle_is_a_clean_error(tmp_path):
    write(tmp_path / "a.yaml", "extends: b.yaml\nname: a\n")
    write(tmp_path / "b.yaml", "extends: a.yaml\nname: b\n")
    error = load_error(tmp_path / "a.yaml")
    assert [i.path for i in error.issues] == ["extends"]
    assert "loops" in error.issues[0].message and "b.yaml" in error.issues[0].message


def test_extends_itself_is_a_clean_error(tmp_path):
    error = load_error(write(tmp_path / "a.yaml", "extends: a.yaml\nname: a\n"))
    assert [i.path for i in error.issues] == ["extends"]


def test_extends_missing_preset_lists_presets(tmp_path):
    error = load_error(write(tmp_path / "a.yaml", "extends: no-such-preset\nname: a\n"))
    assert [i.path for i in error.issues] == ["extends"]
    assert "tiny-cpu" in error.issues[0].remedy


def test_interpolation(tmp_path):
    spec = write(tmp_path / "run.yaml", "name: exp1\ntrainer:\n  output_dir: out/${name}/${seed}\nseed: 4\n")
    raw, _ = load_spec_dict(spec)
    assert raw["trainer"]["output_dir"] == "out/exp1/4"


def test_missing_interpolation_key_is_a_clean_error(tmp_path):
    error = load_error(write(tmp_path / "run.yaml", "name: a\ntrainer:\n  output_dir: out/${nope}\n"))
    assert [i.path for i in error.issues] == ["trainer.output_dir"]
    assert "nope" in error.issues[0].message


def test_override_scalar(tmp_path):
    spec = write(tmp_path / "run.yaml", "name: a\nalgorithm: {kl_coef: 0.0}\n")
    raw, _ = load_spec_dict(spec, ["algorithm.kl_coef=0.01", "seed=5", "cluster.address=null"])
    assert raw["algorithm"]["kl_coef"] == 0.01
    assert raw["seed"] == 5
    assert raw["cluster"] == {"address": None}


def test_override_applies_before_interpolation(tmp_path):
    spec = write(tmp_path / "run.yaml", "name: a\ntrainer:\n  output_dir: runs/${name}\n")
    raw, _ = load_spec_dict(spec, ["name=renamed"])
    assert raw["trainer"]["output_dir"] == "runs/renamed"


def test_override_list_value(tmp_path):
    raw, _ = load_spec_dict(write(tmp_path / "run.yaml", "name: a\n"), ["model.modalities=[text,image]"])
    assert raw["model"]["modalities"] == ["text", "image"]


def test_override_list_index(tmp_path):
    spec = write(tmp_path / "run.yaml", "name: a\nrewards: [{name: x, weight: 1.0}, {name: y}]\n")
    raw, _ = load_spec_dict(spec, ["rewards.0.weight=2"])
    assert raw["rewards"] == [{"name": "x", "weight": 2}, {"name": "y"}]


def test_override_list_index_out_of_range(tmp_path):
    spec = write(tmp_path / "run.yaml", "name: a\nrewards: [{name: x}]\n")
    error = load_error(spec, ["rewards.3.weight=2"])
    assert [i.path for i in error.issues] == ["rewards.3.weight"]


@pytest.mark.parametrize("bad", ["algorithm.kl_coef", "=3", "a..b=1", ".a=1"])
def test_bad_override_is_a_clean_error(tmp_path, bad):
    error = load_error(write(tmp_path / "run.yaml", "name: a\n"), [bad])
    assert [i.path for i in error.issues] == [""]
    assert "a.b.c=value" in error.issues[0].message


def test_yaml_syntax_error_reports_the_line(tmp_path):
    spec = write(tmp_path / "run.yaml", "name: a\nmodel:\n  path: x\n  dtype: [float32\nseed: 1\n")
    error = load_error(spec)
    assert "not valid YAML at line" in error.issues[0].message
    line = int(error.issues[0].message.split("at line ")[1].split(",")[0])
    assert 4 <= line <= 5  # the open bracket on line 4 is noticed on line 4 or 5


def test_json_spec(tmp_path):
    spec = write(tmp_path / "run.json", json.dumps({"name": "j", "extends": "tiny-cpu", "seed": 9}))
    raw, _ = load_spec_dict(spec)
    assert (raw["name"], raw["seed"], raw["model"]) == ("j", 9, TINY["model"])


def test_json_syntax_error_reports_the_line(tmp_path):
    error = load_error(write(tmp_path / "run.json", '{"name": "j",\n "seed": }\n'))
    assert "not valid JSON" in error.issues[0].message and "line 2" in error.issues[0].message


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_non_mapping_file_is_a_clean_error(tmp_path, text):
    error = load_error(write(tmp_path / "run.yaml", text))
    assert "not a mapping" in error.issues[0].message


def test_missing_file_is_a_clean_error(tmp_path):
    error = load_error(tmp_path / "absent.yaml")
    assert "neither a file nor a preset" in error.issues[0].message


def test_yaml_is_loaded_safely(tmp_path):
    spec = write(tmp_path / "run.yaml", "name: !!python/object/apply:os.system ['echo pwned']\n")
    error = load_error(spec)
    assert "not valid YAML" in error.issues[0].message


def test_own_data_on_top_of_a_preset_drops_the_presets_dataset_options(tmp_path):
    (tmp_path / "my.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    spec = write(tmp_path / "run.yaml", "extends: tiny-cpu\nname: mine\ndata:\n  train: {source: my.jsonl}\n")
    raw, base = load_spec_dict(spec)
    assert raw["data"]["train"] == {"source": "my.jsonl"}  # {size: 4096} was arithmetic's
    assert raw["data"]["prompt_key"] == "prompt"  # the rest of data still merges
    from relax.spec import validate_spec
    assert validate_spec(raw, base_dir=base).data.train.options == {}


def test_the_same_plugin_keeps_merging_its_options(tmp_path):
    spec = write(tmp_path / "run.yaml", "extends: tiny-cpu\nname: mine\n"
                                        "data: {train: {source: 'synthetic:arithmetic', options: {seed: 3}}}\n")
    raw, _ = load_spec_dict(spec)
    assert raw["data"]["train"]["options"] == {"size": 4096, "seed": 3}


@pytest.mark.parametrize("empty", ["{}", "null"])
def test_an_empty_mapping_or_null_in_a_child_replaces_the_parents(tmp_path, empty):
    spec = write(tmp_path / "run.yaml", f"extends: tiny-cpu\nname: mine\ndata: {{train: {{options: {empty}}}}}\n")
    raw, _ = load_spec_dict(spec)
    assert raw["data"]["train"]["source"] == "synthetic:arithmetic"
    assert raw["data"]["train"]["options"] in ({}, None)


def test_another_backend_drops_the_parents_backend_options(tmp_path):
    parent = write(tmp_path / "base.yaml", "name: b\nroles: {rollout: {backend: hf, options: {threads: 2}}}\n")
    child = write(tmp_path / "run.yaml", f"extends: {parent.name}\nroles: {{rollout: {{backend: vllm}}}}\n")
    raw, _ = load_spec_dict(child)
    assert raw["roles"]["rollout"] == {"backend": "vllm"}
    same = write(tmp_path / "same.yaml", f"extends: {parent.name}\nroles: {{rollout: {{backend: hf, replicas: 2}}}}\n")
    assert load_spec_dict(same)[0]["roles"]["rollout"]["options"] == {"threads": 2}
