"""Data sets read from local files: JSON lines / JSON (``jsonl``), Parquet (``parquet``), and through
the ``datasets`` library CSV (``csv``), Arrow (``arrow``) and folders written by
``Dataset.save_to_disk`` (``dataset_folder``).

Each row is a mapping holding at least the spec's ``data.prompt_key`` and, for rewards that compare
against a label, ``data.label_key``. Rows are read once, when the data set is built. Nothing is
downloaded: ``datasets`` reads the local file (``relax.spec.data_files`` says which source picks
which plugin).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


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


def _check_prompt(row: dict[str, Any], key: str | None, where: str) -> None:
    if key is not None and key in row and not isinstance(row[key], str):
        value = json.dumps(row[key])
        raise DatasetFileError(f"{where}: the prompt ('{key}', data.prompt_key) is {value[:60]}, not text; "
                               "give every row a text prompt, or remove the row")


def _existing(path: str, suffixes: tuple[str, ...]) -> Path:
    file = Path(path).expanduser()
    if not file.is_file():
        raise DatasetFileError(f"data file {file} does not exist; give the path of a "
                               f"{' or '.join(suffixes)} file")
    return file


class JsonlDataset:
    """Rows of a ``.jsonl`` file (one JSON object per line; blank lines are skipped) or of a
    ``.json`` file holding a list of objects."""

    class Config(_FileConfig):
        """Options of a JSON-lines / JSON data set."""

    def __init__(self, config: JsonlDataset.Config) -> None:
        self.config = config
        self.path = _existing(config.path, (".jsonl", ".json"))
        self.rows: list[dict[str, Any]] = self._read()

    def _read(self) -> list[dict[str, Any]]:
        raw = self.path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:  # name the line: the file may be long
            line = raw[:exc.start].count(b"\n") + 1
            raise DatasetFileError(f"{self.path}:{line}: not UTF-8 text (byte "
                                   f"{raw[exc.start]:#04x}); save the file as UTF-8") from None
        limit = self.config.limit
        if self.path.suffix == ".json":
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DatasetFileError(f"{self.path}:{exc.lineno}: invalid JSON ({exc.msg}); "
                                       "fix the file, or use one JSON object per line (.jsonl)") from None
            if not isinstance(data, list):
                raise DatasetFileError(f"{self.path}: a .json data file must hold a list of objects, "
                                       f"not a {type(data).__name__}")
            for i, row in enumerate(data):
                if not isinstance(row, dict):
                    raise DatasetFileError(f"{self.path}: item {i} is a {type(row).__name__}, not an "
                                           "object; every row must be a JSON object")
                _check_prompt(row, self.config.prompt_key, f"{self.path}: item {i}")
            return data[:limit] if limit else data
        rows: list[dict[str, Any]] = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetFileError(f"{self.path}:{lineno}: invalid JSON ({exc.msg} at column "
                                       f"{exc.colno}); each line must be one JSON object") from None
            if not isinstance(row, dict):
                raise DatasetFileError(f"{self.path}:{lineno}: a {type(row).__name__}, not an object; "
                                       "each line must be one JSON object")
            _check_prompt(row, self.config.prompt_key, f"{self.path}:{lineno}")
            rows.append(row)
            if limit and len(rows) >= limit:
                break
        return rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.rows[index]


class _TableRows:
    """Rows listed once from a table (a data file of prompts fits in memory), each prompt checked."""

    config: _FileConfig
    path: Path

    def _keep(self, rows: list[dict[str, Any]]) -> None:
        for i, row in enumerate(rows):
            _check_prompt(row, self.config.prompt_key, f"{self.path}: row {i}")
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
            table = pq.read_table(self.path)
        except Exception as exc:  # pyarrow raises its own error types
            raise DatasetFileError(f"{self.path}: not a readable Parquet file ({exc})") from None
        if self.config.limit:
            table = table.slice(0, self.config.limit)
        self._keep(table.to_pylist())


def _quiet_datasets() -> Any:
    """The ``datasets`` module with its progress bars off (a run prints its own progress)."""
    try:
        import datasets
    except ImportError:
        raise DatasetFileError("reading this data needs the `datasets` package, which is not installed; "
                               "run `pip install datasets`, or convert the file to .jsonl") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


class _LibraryDataset(_TableRows):
    """Rows of a ``datasets.Dataset``."""

    def _take(self, dataset: Any) -> None:
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
        datasets = _quiet_datasets()
        try:
            with open(self.path, encoding="utf-8", newline="") as handle:
                header = next(csv.reader(handle), [])
            text = datasets.Features({name: datasets.Value("string") for name in header})
            dataset = datasets.load_dataset("csv", data_files=str(self.path), split="train", features=text,
                                            keep_default_na=False, na_values=[""])
        except Exception as exc:  # datasets wraps pandas/pyarrow errors in its own types
            raise DatasetFileError(f"{self.path}: not a readable CSV file ({exc}); give a UTF-8 CSV file "
                                   "whose first row names the columns") from None
        self._take(dataset)


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
