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

The rows read are bounded as the dataset plugins bound every row (``RowLimits``): a JSON line or a
CSV header is read with a byte bound (a 100 MB line or a 10-million-column header is refused after
reading ``max_row_bytes``, not parsed), the columns of every format are counted, and under
``data.on_long_prompt: refuse`` a prompt past ``data.max_prompt_tokens`` x 32 characters is an
issue naming its file and line.
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax.contracts import MAX_COLUMNS, MAX_ROW_BYTES, PROMPT_CHARS_PER_TOKEN, LongPromptPolicy
from relax.errors import SpecIssue

#: File suffix -> the ``relax.datasets`` plugin that reads it.
DATA_FILE_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
#: The plugin reading a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``.
FOLDER_PLUGIN = "dataset_folder"
#: Rows of a row-by-row file whose columns validation reads (enough to catch a misnamed column).
DATA_ROWS_CHECKED = 20
FORMATS = "a .jsonl, .json, .csv, .parquet or .arrow file, or a folder written by Dataset.save_to_disk"


@dataclass(frozen=True)
class RowLimits:
    """The bounds validation checks the rows it reads against: those the file plugins apply to
    every row (``relax_plugins.datasets.files``)."""

    max_row_bytes: int = MAX_ROW_BYTES
    max_columns: int = MAX_COLUMNS
    prompt_key: str | None = None
    max_prompt_chars: int | None = None
    """``data.max_prompt_tokens`` x ``PROMPT_CHARS_PER_TOKEN``."""
    on_long_prompt: LongPromptPolicy = "truncate"

    def row_issues(self, row: dict[str, Any], where: str, spec_path: str) -> list[SpecIssue]:
        """What is wrong with one parsed row: too many columns, or a prompt refused for its length."""
        issues = []
        if len(row) > self.max_columns:
            issues.append(self.columns_issue(len(row), where, spec_path))
        prompt = row.get(self.prompt_key) if self.prompt_key is not None else None
        if (self.on_long_prompt == "refuse" and self.max_prompt_chars is not None and isinstance(prompt, str)
                and len(prompt) > self.max_prompt_chars):
            issues.append(SpecIssue("data.on_long_prompt", f"{where}: the prompt ('{self.prompt_key}') has "
                                    f"{len(prompt)} characters, more than data.max_prompt_tokens x "
                                    f"{PROMPT_CHARS_PER_TOKEN} = {self.max_prompt_chars} (data.on_long_prompt: refuse)",
                                    "shorten it, remove the row, raise data.max_prompt_tokens, or set "
                                    "data.on_long_prompt: truncate"))
        return issues

    def columns_issue(self, count: int, where: str, spec_path: str) -> SpecIssue:
        return SpecIssue(spec_path, f"{where}: {count} columns, more than {self.max_columns}",
                         "a data file of prompts needs a few columns: drop the others, or raise "
                         f"{spec_path.rsplit('.', 1)[0]}.options.max_columns")

    def size_issue(self, where: str, spec_path: str) -> SpecIssue:
        return SpecIssue(spec_path, f"{where}: a row of more than {self.max_row_bytes} bytes",
                         "fix the file (a missing line break, a pasted blob), or raise "
                         f"{spec_path.rsplit('.', 1)[0]}.options.max_row_bytes")


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


def data_columns(resolved: Path, source: str, spec_path: str,
                 limits: RowLimits | None = None) -> tuple[list[set[str]] | None, list[SpecIssue]]:
    """The column names of a data set's first rows (one set per row; one set for a columnar
    format), or None when they cannot be read here; malformed rows, and rows past ``limits``, are
    issues naming their line."""
    limits = limits or RowLimits()
    suffix = resolved.suffix.lower()
    if resolved.is_dir():
        return _counted(_folder_columns(resolved, spec_path), resolved, spec_path, limits)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return _counted(([set(pq.read_schema(resolved).names)], []), resolved, spec_path, limits)
        except Exception as exc:  # pyarrow raises its own error types
            return None, [SpecIssue(spec_path, f"{resolved} is not a readable Parquet file ({exc})",
                                    "give a Parquet file, or convert the data to .jsonl")]
    if suffix == ".arrow":
        return _counted(_arrow_columns(resolved, spec_path), resolved, spec_path, limits)
    if suffix == ".csv":
        return _csv_columns(resolved, spec_path, limits)
    if suffix == ".json":
        return _json_columns(resolved, spec_path, limits)
    return _jsonl_columns(resolved, spec_path, limits)


def _counted(found: tuple[list[set[str]] | None, list[SpecIssue]], resolved: Path, spec_path: str,
             limits: RowLimits) -> tuple[list[set[str]] | None, list[SpecIssue]]:
    """A columnar format's columns, with an issue when there are more than ``limits`` allows."""
    columns, issues = found
    if columns and len(columns[0]) > limits.max_columns:
        return columns, [*issues, limits.columns_issue(len(columns[0]), str(resolved), spec_path)]
    return columns, issues


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


def _csv_columns(resolved: Path, spec_path: str, limits: RowLimits) -> tuple[list[set[str]] | None, list[SpecIssue]]:
    try:
        with open(resolved, "rb") as handle:
            first = handle.readline(limits.max_row_bytes + 1)
        if len(first) > limits.max_row_bytes and not first.endswith(b"\n"):
            return None, [limits.size_issue(f"{resolved}:1 (the header row)", spec_path)]
        if (width := _csv_width(first)) > limits.max_columns:  # counted before a field is built
            return None, [limits.columns_issue(width, f"{resolved}:1 (the header row)", spec_path)]
        header = next(csv.reader([first.decode("utf-8-sig")]), None)
    except (UnicodeDecodeError, csv.Error) as exc:
        return None, [SpecIssue(spec_path, f"{resolved}: the header row cannot be read ({exc})",
                                "save the file as UTF-8 CSV with a header row naming the columns")]
    if not header:
        return [], [SpecIssue(spec_path, f"data file {resolved} is empty",
                              "give a CSV file whose first row names the columns")]
    if len(header) > limits.max_columns:
        return None, [limits.columns_issue(len(header), f"{resolved}:1 (the header row)", spec_path)]
    return [{name.strip() for name in header}], []


_QUOTED = re.compile(rb'"(?:[^"]|"")*"')


def _csv_width(line: bytes) -> int:
    """The fields of one CSV line, counted without building them (a 10-million-column header
    costs one pass over its bytes, not ten million strings): commas outside quoted fields, plus one."""
    return _QUOTED.sub(b"", line).count(b",") + 1


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


def _json_columns(resolved: Path, spec_path: str, limits: RowLimits) -> tuple[list[set[str]] | None, list[SpecIssue]]:
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
            issues += limits.row_issues(row, f"{resolved}: item {i}", spec_path)
        else:
            issues.append(SpecIssue(spec_path, f"{resolved}: item {i} is a {type(row).__name__}, not an object",
                                    "every row must be a JSON object"))
    return columns, issues


def _jsonl_columns(resolved: Path, spec_path: str, limits: RowLimits) -> tuple[list[set[str]] | None, list[SpecIssue]]:
    columns: list[set[str]] = []
    issues: list[SpecIssue] = []
    cap = limits.max_row_bytes
    with open(resolved, "rb") as handle:
        lineno = 0
        while len(columns) + len(issues) < DATA_ROWS_CHECKED and (raw := handle.readline(cap + 1)):
            lineno += 1
            if len(raw) > cap and not raw.endswith(b"\n"):  # read no further into it, nor past it
                issues.append(limits.size_issue(f"{resolved}:{lineno}", spec_path))
                break
            line = raw.decode("utf-8", errors="replace")
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
            issues += limits.row_issues(row, f"{resolved}:{lineno}", spec_path)
    if not columns and not issues:
        issues.append(SpecIssue(spec_path, f"data file {resolved} has no rows",
                                "give a file with one JSON object per line"))
    return columns, issues


def data_rows(resolved: Path, split: str = "train") -> int | None:
    """How many rows a data file or saved folder holds, as its dataset plugin reads them (before
    its ``limit`` option), counted without building the data set: non-blank lines of JSON lines,
    the items of a JSON list, the non-empty records after a CSV header, Parquet's metadata, the
    rows of Arrow record batches, those of a saved folder's Arrow files (``split`` of a
    ``DatasetDict``). None when the file cannot be read (its own issue says why)."""
    try:
        if resolved.is_dir():
            return _folder_rows(resolved, split)
        suffix = resolved.suffix.lower()
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return int(pq.read_metadata(resolved).num_rows)
        if suffix == ".arrow":
            return _arrow_rows(resolved)
        if suffix == ".csv":
            with open(resolved, encoding="utf-8", newline="") as handle:
                records = sum(1 for record in csv.reader(handle) if record)
            return max(records - 1, 0)
        if suffix == ".json":
            rows = json.loads(resolved.read_text(encoding="utf-8"))
            return len(rows) if isinstance(rows, list) else None
        with open(resolved, encoding="utf-8", errors="replace") as handle:
            return sum(1 for line in handle if line.strip())
    except Exception:  # unreadable: reported by the column checks
        return None


def _arrow_rows(resolved: Path) -> int | None:
    import pyarrow as pa

    for opener in (pa.ipc.open_stream, pa.ipc.open_file):
        try:
            with pa.memory_map(str(resolved)) as source:
                reader = opener(source)
                if hasattr(reader, "num_record_batches"):
                    return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
                return sum(batch.num_rows for batch in reader)
        except Exception:  # the other layout
            continue
    return None


def _folder_rows(resolved: Path, split: str) -> int | None:
    folder = resolved
    splits = resolved / "dataset_dict.json"
    if not (resolved / "dataset_info.json").is_file() and splits.is_file():
        names = json.loads(splits.read_text(encoding="utf-8")).get("splits", [])
        folder = resolved / (split if split in names else (names[0] if names else split))
    state = folder / "state.json"
    if not state.is_file():
        return None
    files = [entry.get("filename") for entry in json.loads(state.read_text(encoding="utf-8")).get("_data_files", [])]
    counts = [_arrow_rows(folder / name) for name in files if name]
    return None if any(c is None for c in counts) else sum(c for c in counts if c is not None)
