"""The arithmetic data set and the file data sets."""

from __future__ import annotations

import json

import pytest

from relax.registry import get_registry


def _build(name, **options):
    registry = get_registry()
    cls = registry.load("datasets", name)
    return cls(registry.build_config("datasets", name, options))


def test_arithmetic_is_deterministic_and_correct():
    data = _build("synthetic:arithmetic", size=50, seed=3)
    again = _build("synthetic:arithmetic", size=50, seed=3)
    other = _build("synthetic:arithmetic", size=50, seed=4)
    assert len(data) == 50
    items = [data[i] for i in range(50)]
    assert items == [again[i] for i in range(50)]
    assert items != [other[i] for i in range(50)]
    for item in items:
        assert set(item) == {"prompt", "answer"}
        left, right = item["prompt"].rstrip("=").split("+")
        assert item["prompt"].endswith("=") and int(item["answer"]) == int(left) + int(right)
        assert 0 <= int(left) <= 9 and 0 <= int(right) <= 9
    assert data[-1] == data[49]
    with pytest.raises(IndexError):
        data[50]


def test_arithmetic_operations():
    data = _build("synthetic:arithmetic", size=200, operations=["-", "*"], max_operand=20)
    for i in range(200):
        prompt, answer = data[i]["prompt"], data[i]["answer"]
        op = "-" if "-" in prompt else "*"
        a, b = (int(x) for x in prompt.rstrip("=").split(op))
        assert int(answer) == (a - b if op == "-" else a * b)


def test_jsonl_reads_rows_and_skips_blank_lines(tmp_path):
    file = tmp_path / "d.jsonl"
    file.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": 4}\n')
    data = _build("jsonl", path=str(file))
    assert len(data) == 2 and data[1] == {"prompt": "2+2=", "answer": 4}
    assert len(_build("jsonl", path=str(file), limit=1)) == 1


def test_json_list(tmp_path):
    file = tmp_path / "d.json"
    file.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}]))
    assert [row["prompt"] for row in _build("jsonl", path=str(file)).rows] == ["a", "b"]


def test_bad_json_names_file_and_line(tmp_path):
    file = tmp_path / "bad.jsonl"
    file.write_text('{"prompt": "ok"}\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        _build("jsonl", path=str(file))


def test_non_object_row_is_an_error(tmp_path):
    file = tmp_path / "list.jsonl"
    file.write_text('[1, 2]\n')
    with pytest.raises(ValueError, match=r"list\.jsonl:1: a list, not an object"):
        _build("jsonl", path=str(file))


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        _build("jsonl", path=str(tmp_path / "nope.jsonl"))


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    file = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["1+1="], "answer": ["2"]}), file)
    assert _build("parquet", path=str(file))[0] == {"prompt": "1+1=", "answer": "2"}


ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+3=", "answer": "5"}, {"prompt": "4+4=", "answer": "8"}]


def _write(tmp_path, fmt: str):
    """ROWS in one of the formats the ``datasets`` library reads: (plugin name, path)."""
    import datasets
    import pyarrow as pa

    table = datasets.Dataset.from_list(ROWS)
    if fmt == "csv":
        path = tmp_path / "d.csv"
        path.write_text("prompt,answer\n" + "".join(f"{r['prompt']},{r['answer']}\n" for r in ROWS))
        return "csv", path
    if fmt == "arrow-stream":  # what datasets writes (Dataset.from_file reads it)
        folder = tmp_path / "saved"
        table.save_to_disk(str(folder))
        return "arrow", next(folder.glob("*.arrow"))
    if fmt == "arrow-file":  # pyarrow's own file format
        path = tmp_path / "d.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.data.schema) as writer:
            writer.write_table(table.data.table)
        return "arrow", path
    if fmt == "folder":
        table.save_to_disk(str(tmp_path / "saved"))
        return "dataset_folder", tmp_path / "saved"
    datasets.DatasetDict({"train": table, "test": table.select([0])}).save_to_disk(str(tmp_path / "dict"))
    return "dataset_folder", tmp_path / "dict"


@pytest.mark.parametrize("fmt", ["csv", "arrow-stream", "arrow-file", "folder", "dict-folder"])
def test_datasets_library_formats_read_every_row(tmp_path, fmt):
    name, path = _write(tmp_path, fmt)
    data = _build(name, path=str(path))
    assert [data[i] for i in range(len(data))] == ROWS
    assert len(_build(name, path=str(path), limit=2)) == 2


def test_a_saved_dataset_dict_reads_the_split_asked_for(tmp_path):
    name, path = _write(tmp_path, "dict-folder")
    assert len(_build(name, path=str(path), split="test")) == 1
    with pytest.raises(ValueError, match="no split 'valid' .*train, test.*data.train.options.split"):
        _build(name, path=str(path), split="valid")


def test_a_folder_that_is_not_a_saved_dataset_is_named(tmp_path):
    with pytest.raises(ValueError, match="is not a saved dataset folder"):
        _build("dataset_folder", path=str(tmp_path))


def test_csv_cells_are_text_as_written_and_an_empty_prompt_is_refused(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("prompt,answer\n7+0=,007\n1e3,NA\n")
    assert _build("csv", path=str(path)).rows == [{"prompt": "7+0=", "answer": "007"}, {"prompt": "1e3", "answer": "NA"}]
    path.write_text("prompt,answer\n1+1=,2\n,3\n")
    with pytest.raises(ValueError, match="row 1: the prompt .* is null, not text"):
        _build("csv", path=str(path), prompt_key="prompt")
