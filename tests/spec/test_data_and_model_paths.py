"""What ``relax validate`` reads of the user's own data and model before anything starts: the
columns of each data format's first rows (with a "did you mean" for a misnamed key), data paths
(``~`` expanded, relative to the spec's folder), model folders without a tokenizer and mistyped
folders that look like hub ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.config import load_spec_dict
from relax.plan.wiring import dataset_use
from relax.spec import SpecError, validate_spec
from relax.spec.data_files import dataset_plugin

ROWS = [{"question": "1+1=", "answer": "2"}, {"question": "2+2=", "answer": "4"}]


def write_data(folder: Path, fmt: str) -> str:
    """ROWS in a format; the source to name in the spec."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = datasets.Dataset.from_list(ROWS)
    if fmt == "jsonl":
        (folder / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
        return "d.jsonl"
    if fmt == "json":
        (folder / "d.json").write_text(json.dumps(ROWS))
        return "d.json"
    if fmt == "csv":
        (folder / "d.csv").write_text("question,answer\n1+1=,2\n")
        return "d.csv"
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(ROWS), folder / "d.parquet")
        return "d.parquet"
    if fmt == "arrow":
        with pa.OSFile(str(folder / "d.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.data.schema) as w:
            w.write_table(table.data.table)
        return "d.arrow"
    if fmt == "folder":
        table.save_to_disk(str(folder / "saved"))
        return "./saved"
    datasets.DatasetDict({"train": table}).save_to_disk(str(folder / "splits"))
    return "./splits"


def issues_of(raw: dict, base: Path) -> dict:
    with pytest.raises(SpecError) as caught:
        validate_spec(raw, base_dir=base, runnable=True)
    return {i.path: i for i in caught.value.issues}


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "arrow", "folder", "dict-folder"])
def test_a_prompt_key_typo_is_caught_in_every_format_with_a_suggestion(tmp_path, fmt):
    source = write_data(tmp_path, fmt)
    (tmp_path / "run.yaml").write_text(f"extends: tiny-cpu\nname: mine\ndata: {{train: {{source: '{source}'}}, "
                                       "prompt_key: questoin}\n")
    raw, base = load_spec_dict(tmp_path / "run.yaml")
    issues = issues_of(raw, base)
    assert set(issues) == {"data.prompt_key"}
    assert "'questoin' is not a column" in issues["data.prompt_key"].message
    assert "question" in issues["data.prompt_key"].remedy  # did you mean 'question'?
    raw["data"]["prompt_key"] = "question"
    assert validate_spec(raw, base_dir=base, runnable=True).data.prompt_key == "question"


def test_sources_pick_their_plugin():
    assert dataset_plugin("synthetic:arithmetic") == ("synthetic:arithmetic", {})
    assert dataset_plugin("data/train.csv") == ("csv", {"path": "data/train.csv"})
    assert dataset_plugin("x.arrow")[0] == "arrow"
    assert dataset_plugin("~/data/saved")[0] == "dataset_folder"
    assert dataset_plugin("./saved")[0] == "dataset_folder"


def test_a_home_relative_data_path_is_expanded_for_validation_and_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    elsewhere = tmp_path / "specs"
    elsewhere.mkdir()
    raw, base = load_spec_dict("tiny-cpu", ["data.train.source=~/d.jsonl"])
    spec = validate_spec(raw, base_dir=elsewhere, runnable=True)
    assert dataset_use(spec, elsewhere).options["path"] == str(tmp_path / "d.jsonl")


def test_a_relative_data_path_is_taken_from_the_specs_folder(tmp_path, monkeypatch):
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "d.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "specs" / "run.yaml").write_text("extends: tiny-cpu\nname: mine\ndata: {train: {source: d.jsonl}}\n")
    monkeypatch.chdir(tmp_path)  # the working folder holds no d.jsonl
    raw, base = load_spec_dict("specs/run.yaml")
    spec = validate_spec(raw, base_dir=base, runnable=True)
    assert dataset_use(spec, base).options["path"] == str(tmp_path / "specs" / "d.jsonl")
    raw["data"]["train"]["source"] = "nope.jsonl"
    issue = issues_of(raw, base)["data.train.source"]
    assert str(tmp_path / "specs" / "nope.jsonl") in issue.message and "spec's folder" in issue.remedy


def test_a_model_folder_without_tokenizer_files_is_refused(tmp_path):
    from relax.runtime.model_files import materialize_path

    built = Path(materialize_path("builtin:tiny-lm", {}, tmp_path))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((built / "config.json").read_text())
    raw, _ = load_spec_dict("tiny-cpu", ["model.path=model", "model.options=null"])
    issue = issues_of(raw, tmp_path)["model.path"]
    assert "has no tokenizer files" in issue.message and "save_pretrained" in issue.remedy
    for name in built.iterdir():  # the whole folder: valid
        if name.is_file():
            (model / name.name).write_bytes(name.read_bytes())
    assert validate_spec(raw, base_dir=tmp_path, runnable=True).model.path == "model"


def test_a_mistyped_folder_that_looks_like_a_hub_id_is_refused(tmp_path):
    (tmp_path / "models" / "my_model").mkdir(parents=True)
    raw, _ = load_spec_dict("tiny-cpu", ["model.path=models/my-model", "model.options=null"])
    issue = issues_of(raw, tmp_path)["model.path"]
    assert f"no such folder: {tmp_path / 'models' / 'my-model'}" in issue.message
    assert "Relax never downloads" in issue.message


def test_a_chat_template_file_is_checked_before_the_run(tmp_path):
    raw, _ = load_spec_dict("tiny-cpu", ["data.chat_template=chat.jinja"])
    issue = issues_of(raw, tmp_path)["data.chat_template"]
    assert "neither auto, none nor an existing file" in issue.message and str(tmp_path / "chat.jinja") in issue.message
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}{{ m['content'] }\n")
    issue = issues_of(raw, tmp_path)["data.chat_template"]
    assert "line 1: not a valid Jinja template" in issue.message
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert validate_spec(raw, base_dir=tmp_path, runnable=True).data.chat_template == "chat.jinja"
