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
    file = tmp_path / "d.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        file.write_bytes(b"PAR1")
        with pytest.raises(ValueError, match="pip install pyarrow"):
            _build("parquet", path=str(file))
        return
    pq.write_table(pa.table({"prompt": ["1+1="], "answer": ["2"]}), file)
    assert _build("parquet", path=str(file))[0] == {"prompt": "1+1=", "answer": "2"}
