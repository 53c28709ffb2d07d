"""Data given as a path in ``data.*.source``: which dataset plugin reads it, where the path points,
and the column names of its first rows, read cheaply for ``relax validate``.

A source is a path when it ends in a data file suffix (``.jsonl``, ``.json``, ``.csv``,
``.parquet``, ``.arrow``) or looks like one (it holds a ``/`` or starts with ``~`` or ``.``); a path
without a data suffix is a folder written by ``datasets.Dataset.save_to_disk``. Anything else is a
``relax.datasets`` plugin name (``synthetic:arithmetic``). Paths are taken from the spec's folder
after ``~`` is expanded, like ``model.path``.

Reading columns imports no torch and not the ``datasets`` library: JSON lines are parsed a row at a
time, a CSV file's header row is read with the standard library, Parquet and Arrow schemas with
pyarrow, a saved dataset's features from its ``dataset_info.json``.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from relax.spec.errors import SpecIssue

#: File suffix -> the ``relax.datasets`` plugin that reads it.
DATA_FILE_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
#: The plugin reading a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``.
FOLDER_PLUGIN = "dataset_folder"
#: Rows of a row-by-row file whose columns validation reads (enough to catch a misnamed column).
DATA_ROWS_CHECKED = 20
FORMATS = "a .jsonl, .json, .csv, .parquet or .arrow file, or a folder written by Dataset.save_to_disk"


def looks_like_path(source: str) -> bool:
    """Whether ``data.*.source`` names a file or folder rather than a plugin."""
    return Path(source).suffix.lower() in DATA_FILE_SUFFIXES or "/" in source or source.startswith(("~", "."))


def dataset_plugin(source: str) -> tuple[str, dict[str, Any]]:
    """The dataset plugin a ``data.*.source`` names, and options it implies (a file's path)."""
    if not looks_like_path(source):
        return source, {}
    return DATA_FILE_SUFFIXES.get(Path(source).suffix.lower(), FOLDER_PLUGIN), {"path": source}


def data_path(source: str, base_dir: Path) -> Path:
    """Where a data path points: ``~`` expanded, a relative path taken from the spec's folder."""
    try:
        path = Path(source).expanduser()
    except RuntimeError:  # "~user/..." for a user that does not exist
        path = Path(source)
    return path if path.is_absolute() else base_dir / path


def missing_data_issue(source: str, resolved: Path, spec_path: str) -> SpecIssue | None:
    """An issue when the path does not hold what its plugin reads (a file, or a saved folder)."""
    folder = dataset_plugin(source)[0] == FOLDER_PLUGIN
    if folder and resolved.is_dir():
        return None
    if not folder and resolved.is_file():
        return None
    if folder and resolved.is_file():
        return SpecIssue(spec_path, f"{source} is a file of a kind Relax does not read (looked at {resolved})",
                         f"give {FORMATS}")
    what = "data folder" if folder else "data file"
    return SpecIssue(spec_path, f"{what} {source} does not exist (looked at {resolved})",
                     f"give an existing path, relative to the spec's folder ({FORMATS})")


def data_columns(resolved: Path, source: str, spec_path: str) -> tuple[list[set[str]] | None, list[SpecIssue]]:
    """The column names of a data set's first rows (one set per row; one set for a columnar
    format), or None when they cannot be read here; malformed rows are issues naming their line."""
    suffix = resolved.suffix.lower()
    if resolved.is_dir():
        return _folder_columns(resolved, spec_path)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return [set(pq.read_schema(resolved).names)], []
        except Exception as exc:  # pyarrow raises its own error types
            return None, [SpecIssue(spec_path, f"{resolved} is not a readable Parquet file ({exc})",
                                    "give a Parquet file, or convert the data to .jsonl")]
    if suffix == ".arrow":
        return _arrow_columns(resolved, spec_path)
    if suffix == ".csv":
        return _csv_columns(resolved, spec_path)
    if suffix == ".json":
        return _json_columns(resolved, spec_path)
    return _jsonl_columns(resolved, spec_path)


def _arrow_columns(resolved: Path, spec_path: str) -> tuple[list[set[str]] | None, list[SpecIssue]]:
    import pyarrow as pa

    for opener in (pa.ipc.open_stream, pa.ipc.open_file):  # datasets writes streams; pyarrow either
        try:
            with pa.memory_map(str(resolved)) as source:
                return [set(opener(source).schema.names)], []
        except Exception:  # pyarrow raises its own error types; try the other layout
            continue
    return None, [SpecIssue(spec_path, f"{resolved} is not a readable Arrow file (stream or file format)",
                            "give an Arrow file written by datasets or pyarrow, or convert the data to .jsonl")]


def _csv_columns(resolved: Path, spec_path: str) -> tuple[list[set[str]] | None, list[SpecIssue]]:
    try:
        with open(resolved, encoding="utf-8", newline="") as handle:
            header = next(csv.reader(handle), None)
    except (UnicodeDecodeError, csv.Error) as exc:
        return None, [SpecIssue(spec_path, f"{resolved}: the header row cannot be read ({exc})",
                                "save the file as UTF-8 CSV with a header row naming the columns")]
    if not header:
        return [], [SpecIssue(spec_path, f"data file {resolved} is empty",
                              "give a CSV file whose first row names the columns")]
    return [{name.strip() for name in header}], []


def _folder_columns(resolved: Path, spec_path: str) -> tuple[list[set[str]] | None, list[SpecIssue]]:
    info = resolved / "dataset_info.json"
    splits = resolved / "dataset_dict.json"
    if not info.is_file() and splits.is_file():  # a DatasetDict: its train split (the plugin's default)
        try:
            names = json.loads(splits.read_text(encoding="utf-8")).get("splits", [])
        except (ValueError, UnicodeDecodeError):
            names = []
        info = resolved / ("train" if "train" in names else (names[0] if names else "train")) / "dataset_info.json"
    if not info.is_file():
        return None, [SpecIssue(spec_path, f"{resolved} is not a saved dataset folder (it has no dataset_info.json)",
                                f"give {FORMATS}")]
    try:
        features = json.loads(info.read_text(encoding="utf-8")).get("features") or {}
    except (ValueError, UnicodeDecodeError) as exc:
        return None, [SpecIssue(spec_path, f"{info} is not valid JSON ({exc})", "save the dataset again")]
    return ([set(features)], []) if isinstance(features, dict) and features else (None, [])


def _json_columns(resolved: Path, spec_path: str) -> tuple[list[set[str]] | None, list[SpecIssue]]:
    try:
        rows = json.loads(resolved.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        line = f"line {exc.lineno}: " if isinstance(exc, json.JSONDecodeError) else ""
        return [], [SpecIssue(spec_path, f"{resolved}: {line}invalid JSON ({getattr(exc, 'msg', exc)})",
                              "fix the file, or use one JSON object per line (.jsonl)")]
    if not isinstance(rows, list):
        return [], [SpecIssue(spec_path, f"{resolved} holds a {type(rows).__name__}, not a list of objects",
                              "make it a JSON list of objects, or use one JSON object per line (.jsonl)")]
    columns, issues = [], []
    for i, row in enumerate(rows[:DATA_ROWS_CHECKED]):
        if isinstance(row, dict):
            columns.append(set(row))
        else:
            issues.append(SpecIssue(spec_path, f"{resolved}: item {i} is a {type(row).__name__}, not an object",
                                    "every row must be a JSON object"))
    return columns, issues


def _jsonl_columns(resolved: Path, spec_path: str) -> tuple[list[set[str]] | None, list[SpecIssue]]:
    columns: list[set[str]] = []
    issues: list[SpecIssue] = []
    with open(resolved, encoding="utf-8", errors="replace") as handle:
        for lineno, line in enumerate(handle, start=1):
            if len(columns) + len(issues) >= DATA_ROWS_CHECKED:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                issues.append(SpecIssue(spec_path, f"{resolved}: line {lineno} is not valid JSON ({exc.msg} at "
                                        f"column {exc.colno})", "each line must be one JSON object"))
                continue
            if not isinstance(row, dict):
                issues.append(SpecIssue(spec_path, f"{resolved}: line {lineno} is a {type(row).__name__}, not an "
                                        "object", "each line must be one JSON object"))
                continue
            columns.append(set(row))
    if not columns and not issues:
        issues.append(SpecIssue(spec_path, f"data file {resolved} has no rows",
                                "give a file with one JSON object per line"))
    return columns, issues
