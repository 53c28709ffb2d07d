"""Data sets read from local files: JSON lines / JSON (``jsonl``), Parquet (``parquet``), and through
the ``datasets`` library CSV (``csv``), Arrow (``arrow``) and folders written by
``Dataset.save_to_disk`` (``dataset_folder``).

Each row is a mapping holding at least the spec's ``data.prompt_key`` and, for rewards that compare
against a label, ``data.label_key``. Rows are read once, when the data set is built. Nothing is
downloaded: ``datasets`` reads the local file (``relax.spec.data_files`` says which source picks
which plugin).

Every row is bounded as it is read, so a hostile or careless file cannot make the run's memory
grow without end: a row past ``max_row_bytes`` (a JSON line read with that bound, a CSV line, a
table row's text and binary cells) or a file past ``max_columns`` columns (a CSV header is read
with a byte bound before the file reaches ``datasets``) is refused with the file and line, whatever
``on_long_prompt`` says (skipping it would change the data set behind the user's back). A prompt
past ``max_prompt_chars`` (the run sets ``data.max_prompt_tokens`` x 32) is cut to its last
``max_prompt_chars`` characters under ``on_long_prompt: truncate`` (counted in ``truncated``),
refused with its file and line under ``refuse``.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from relax.contracts import MAX_COLUMNS, MAX_ROW_BYTES, LongPromptPolicy


class DatasetFileError(ValueError):
    """A data file cannot be read; the message names the file (and line) and what to fix."""


class _FileConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    """The file to read. From ``data.*.source`` the run passes it with ``~`` expanded and a relative
    path taken from the spec's folder; given here directly, a relative path is taken from the working
    folder."""
    limit: int | None = Field(None, ge=1)
    """Read at most this many rows (all when null)."""
    prompt_key: str | None = None
    """The prompt column (the run sets it to ``data.prompt_key``): when set, a row whose value there is
    not text (null, a number, a list) is refused with the file and line, instead of being trained on
    as the text of that value. A row without the column is left to the run's own message."""
    max_prompt_chars: int | None = Field(None, ge=1)
    """Longest prompt text kept (the run sets it to ``data.max_prompt_tokens`` x 32); null: no bound."""
    on_long_prompt: LongPromptPolicy = "truncate"
    """A prompt past ``max_prompt_chars``: cut to its last ``max_prompt_chars`` characters
    (``truncate``) or refused with the file and line (``refuse``); the run sets ``data.on_long_prompt``."""
    max_row_bytes: int = Field(MAX_ROW_BYTES, ge=1)
    """Largest row, in bytes; a larger one is refused with the file and line."""
    max_columns: int = Field(MAX_COLUMNS, ge=1)
    """Most columns the file may have; more are refused before the rows are read."""


def _check_prompt(row: dict[str, Any], key: str | None, where: str) -> None:
    if key is not None and key in row and not isinstance(row[key], str):
        value = json.dumps(row[key])
        raise DatasetFileError(f"{where}: the prompt ('{key}', data.prompt_key) is {value[:60]}, not text; "
                               "give every row a text prompt, or remove the row")


def _row_bytes(row: dict[str, Any], cap: int) -> int:
    """The bytes of a row's text and binary cells (lists and nested objects walked), counted until
    they pass ``cap``: what a row costs held in memory, near enough to bound it."""
    total, stack = 0, list(row.values())
    while stack and total <= cap:
        value = stack.pop()
        if isinstance(value, str):
            total += len(value) if len(value) * 4 <= cap - total else len(value.encode("utf-8", "surrogatepass"))
        elif isinstance(value, (bytes, bytearray)):
            total += len(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        else:
            total += 8
    return total


class _Bounded:
    """The bounds every file plugin applies to each row (see the module docstring)."""

    config: _FileConfig
    path: Path
    truncated: int = 0
    """Prompts cut to ``max_prompt_chars`` (``on_long_prompt: truncate``)."""

    def _columns_ok(self, count: int, where: str) -> None:
        if count > self.config.max_columns:
            raise DatasetFileError(f"{where}: {count} columns, more than {self.config.max_columns} "
                                   "(data.<split>.options.max_columns); a data file of prompts needs a few columns: "
                                   "drop the others, or raise max_columns")

    def _row_ok(self, row: dict[str, Any], where: str) -> dict[str, Any]:
        """``row`` checked (column count, size, prompt type) with its prompt bounded."""
        config = self.config
        self._columns_ok(len(row), where)
        size = _row_bytes(row, config.max_row_bytes)
        if size > config.max_row_bytes:
            raise DatasetFileError(_too_large(where, config.max_row_bytes))
        _check_prompt(row, config.prompt_key, where)
        key, limit = config.prompt_key, config.max_prompt_chars
        if key is not None and limit is not None and isinstance(row.get(key), str) and len(row[key]) > limit:
            if config.on_long_prompt == "refuse":
                raise DatasetFileError(f"{where}: the prompt ('{key}') has {len(row[key])} characters, more than "
                                       f"{limit} (data.max_prompt_tokens x 32; data.on_long_prompt: refuse); shorten "
                                       "it, remove the row, raise data.max_prompt_tokens, or set "
                                       "data.on_long_prompt: truncate")
            row[key] = row[key][-limit:]  # cut from the left, as its tokens would be
            self.truncated += 1
        return row


_QUOTED = re.compile(rb'"(?:[^"]|"")*"')


def _csv_width(line: bytes) -> int:
    """The fields of one CSV line, counted without building them (a 10-million-column header
    costs one pass over its bytes, not ten million strings): commas outside quoted fields, plus one."""
    return _QUOTED.sub(b"", line).count(b",") + 1


def _too_large(where: str, cap: int) -> str:
    return (f"{where}: a row of more than {cap} bytes (max_row_bytes); a prompt row is far smaller: fix the "
            "file (a missing line break, a pasted blob), or raise data.<split>.options.max_row_bytes")


def _existing(path: str, suffixes: tuple[str, ...]) -> Path:
    file = Path(path).expanduser()
    if not file.is_file():
        raise DatasetFileError(f"data file {file} does not exist; give the path of a "
                               f"{' or '.join(suffixes)} file")
    return file


class JsonlDataset(_Bounded):
    """Rows of a ``.jsonl`` file (one JSON object per line; blank lines are skipped) or of a
    ``.json`` file holding a list of objects. JSON lines are read one at a time with a byte bound."""

    class Config(_FileConfig):
        """Options of a JSON-lines / JSON data set."""

    def __init__(self, config: JsonlDataset.Config) -> None:
        self.config = config
        self.path = _existing(config.path, (".jsonl", ".json"))
        self.rows: list[dict[str, Any]] = self._read_list() if self.path.suffix == ".json" else self._read_lines()

    def _read_list(self) -> list[dict[str, Any]]:
        raw = self.path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:  # name the line: the file may be long
            line = raw[:exc.start].count(b"\n") + 1
            raise DatasetFileError(f"{self.path}:{line}: not UTF-8 text (byte "
                                   f"{raw[exc.start]:#04x}); save the file as UTF-8") from None
        del raw
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DatasetFileError(f"{self.path}:{exc.lineno}: invalid JSON ({exc.msg}); "
                                   "fix the file, or use one JSON object per line (.jsonl)") from None
        if not isinstance(data, list):
            raise DatasetFileError(f"{self.path}: a .json data file must hold a list of objects, "
                                   f"not a {type(data).__name__}")
        limit = self.config.limit
        for i, row in enumerate(data):
            if not isinstance(row, dict):
                raise DatasetFileError(f"{self.path}: item {i} is a {type(row).__name__}, not an "
                                       "object; every row must be a JSON object")
            self._row_ok(row, f"{self.path}: item {i}")
        return data[:limit] if limit else data

    def _read_lines(self) -> list[dict[str, Any]]:
        limit, cap = self.config.limit, self.config.max_row_bytes
        rows: list[dict[str, Any]] = []
        with open(self.path, "rb") as handle:
            lineno = 0
            while line := handle.readline(cap + 1):
                lineno += 1
                if len(line) > cap and not line.endswith(b"\n"):  # read no further into it
                    raise DatasetFileError(_too_large(f"{self.path}:{lineno}", cap))
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DatasetFileError(f"{self.path}:{lineno}: not UTF-8 text (byte "
                                           f"{line[exc.start]:#04x}); save the file as UTF-8") from None
                if not text.strip():
                    continue
                try:
                    row = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise DatasetFileError(f"{self.path}:{lineno}: invalid JSON ({exc.msg} at column "
                                           f"{exc.colno}); each line must be one JSON object") from None
                if not isinstance(row, dict):
                    raise DatasetFileError(f"{self.path}:{lineno}: a {type(row).__name__}, not an object; "
                                           "each line must be one JSON object")
                rows.append(self._row_ok(row, f"{self.path}:{lineno}"))
                if limit and len(rows) >= limit:
                    break
        return rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.rows[index]


class _TableRows(_Bounded):
    """Rows listed once from a table (a data file of prompts fits in memory), each row checked."""

    def _keep(self, rows: list[dict[str, Any]]) -> None:
        for i, row in enumerate(rows):
            self._row_ok(row, f"{self.path}: row {i}")
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.rows[index]


class ParquetDataset(_TableRows):
    """Rows of a ``.parquet`` file (read with pyarrow)."""

    class Config(_FileConfig):
        """Options of a Parquet data set."""

    def __init__(self, config: ParquetDataset.Config) -> None:
        self.config = config
        self.path = _existing(config.path, (".parquet",))
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetFileError(f"reading {self.path} needs pyarrow, which is not installed; "
                                   "run `pip install pyarrow`, or convert the file to .jsonl") from None
        try:
            names = pq.read_schema(self.path).names
        except Exception as exc:  # pyarrow raises its own error types
            raise DatasetFileError(f"{self.path}: not a readable Parquet file ({exc})") from None
        self._columns_ok(len(names), str(self.path))  # from the footer, before any row is read
        try:
            table = pq.read_table(self.path)
        except Exception as exc:  # pyarrow raises its own error types
            raise DatasetFileError(f"{self.path}: not a readable Parquet file ({exc})") from None
        if self.config.limit:
            table = table.slice(0, self.config.limit)
        self._keep(table.to_pylist())


def _quiet_datasets() -> Any:
    """The ``datasets`` module with its progress bars off (a run prints its own progress) and its
    download counter off: ``load_dataset`` of a local file otherwise sends a HEAD request to the
    library's S3 bucket to count the load, and a run reaches no host but its own."""
    try:
        import datasets
    except ImportError:
        raise DatasetFileError("reading this data needs the `datasets` package, which is not installed; "
                               "run `pip install datasets`, or convert the file to .jsonl") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    return datasets


class _LibraryDataset(_TableRows):
    """Rows of a ``datasets.Dataset``."""

    def _take(self, dataset: Any) -> None:
        self._columns_ok(len(dataset.column_names), str(self.path))
        if self.config.limit:
            dataset = dataset.select(range(min(self.config.limit, len(dataset))))
        self._keep(dataset.to_list())


class CsvDataset(_LibraryDataset):
    """Rows of a ``.csv`` file with a header row (read by the ``datasets`` library's CSV builder).
    Every cell is text, as written (a CSV file has no types: a label ``007`` stays ``"007"``, not
    the number 7); an empty cell is null."""

    class Config(_FileConfig):
        """Options of a CSV data set."""

    def __init__(self, config: CsvDataset.Config) -> None:
        self.config = config
        self.path = _existing(config.path, (".csv",))
        header = self._header()
        datasets = _quiet_datasets()
        try:
            text = datasets.Features({name: datasets.Value("string") for name in header})
            dataset = datasets.load_dataset("csv", data_files=str(self.path), split="train", features=text,
                                            keep_default_na=False, na_values=[""])
        except Exception as exc:  # datasets wraps pandas/pyarrow errors in its own types
            raise DatasetFileError(f"{self.path}: not a readable CSV file ({exc}); give a UTF-8 CSV file "
                                   "whose first row names the columns") from None
        self._take(dataset)

    def _header(self) -> list[str]:
        """The header row, read with a byte bound and its columns counted, then every line checked
        against ``max_row_bytes`` (a bounded read each): all before the file reaches ``datasets``,
        so a 10-million-column header or a 100 MB line costs a few bounded reads."""
        cap = self.config.max_row_bytes
        with open(self.path, "rb") as handle:
            first = handle.readline(cap + 1)
            if len(first) > cap and not first.endswith(b"\n"):
                raise DatasetFileError(_too_large(f"{self.path}:1 (the header row)", cap))
            self._columns_ok(_csv_width(first), f"{self.path}:1 (the header row)")
            try:
                header = next(csv.reader([first.decode("utf-8-sig")]), [])
            except (UnicodeDecodeError, csv.Error) as exc:
                raise DatasetFileError(f"{self.path}:1: the header row cannot be read ({exc}); give a UTF-8 CSV "
                                       "file whose first row names the columns") from None
            lineno = 1
            while line := handle.readline(cap + 1):
                lineno += 1
                if len(line) > cap and not line.endswith(b"\n"):
                    raise DatasetFileError(_too_large(f"{self.path}:{lineno}", cap))
        return header


class ArrowDataset(_LibraryDataset):
    """Rows of an ``.arrow`` file: one written by ``datasets`` (an Arrow stream) or by pyarrow (the
    Arrow file format)."""

    class Config(_FileConfig):
        """Options of an Arrow data set."""

    def __init__(self, config: ArrowDataset.Config) -> None:
        self.config = config
        self.path = _existing(config.path, (".arrow",))
        datasets = _quiet_datasets()
        try:
            dataset = datasets.Dataset.from_file(str(self.path))
        except Exception:  # not a stream: the Arrow file format
            import pyarrow as pa

            try:
                with pa.memory_map(str(self.path)) as source:
                    dataset = datasets.Dataset(pa.ipc.open_file(source).read_all())
            except Exception as exc:  # pyarrow raises its own error types
                raise DatasetFileError(f"{self.path}: not a readable Arrow file ({exc})") from None
        self._take(dataset)


class DatasetFolder(_LibraryDataset):
    """Rows of a folder written by ``Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``: one
    split of it)."""

    class Config(_FileConfig):
        """Options of a saved dataset folder."""

        split: str = "train"
        """The split to read when the folder holds a ``DatasetDict`` (ignored for a ``Dataset``)."""

    def __init__(self, config: DatasetFolder.Config) -> None:
        self.config = config
        self.path = Path(config.path).expanduser()
        if not self.path.is_dir():
            raise DatasetFileError(f"data folder {self.path} does not exist; give a folder written by "
                                   "Dataset.save_to_disk, or a .jsonl/.json/.csv/.parquet/.arrow file")
        datasets = _quiet_datasets()
        try:
            dataset = datasets.load_from_disk(str(self.path))
        except Exception as exc:  # FileNotFoundError and datasets' own errors
            raise DatasetFileError(f"{self.path} is not a saved dataset folder ({exc}); give a folder "
                                   "written by Dataset.save_to_disk") from None
        if isinstance(dataset, datasets.DatasetDict):
            if config.split not in dataset:
                raise DatasetFileError(f"{self.path} has no split '{config.split}' (it has "
                                       f"{', '.join(dataset)}); set data.train.options.split")
            dataset = dataset[config.split]
        self._take(dataset)
