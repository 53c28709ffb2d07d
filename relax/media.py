"""Media references: how images, audio and video travel between roles without being decoded twice
on the bus.

A sample's media never go through the bus or the control plane as pixels or waveforms. The rollout
turns each media item of a data row into a ``MediaRef``: a local path (a data set's own file, or
a content-addressed copy of an inline item written once under the run folder) plus the sha256 of
its bytes and a few numbers of metadata. That small JSON record is what the bus carries. Every
role that needs the media decodes its own view from the path through the same ``relax.modalities``
plugin, after checking that the bytes still hash to the recorded sha256: the rollout and the
trainer provably saw the same media.

Nothing here knows about a particular modality: decoding, checks and budgets belong to the
modality plugins (``relax_plugins/modalities``). This module imports only the standard library.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: Bytes read at a time when hashing a file.
_CHUNK = 1 << 20


class MediaError(ValueError):
    """A media item cannot be used: missing, undecodable, or outside the spec's budgets. The
    message says what is wrong with the item; ``BadSample`` adds which sample and key."""


class BadSample(ValueError):
    """A data row whose media cannot be used: names the sample, the column and the cause."""

    def __init__(self, index: int | str, key: str, cause: str) -> None:
        self.index, self.key, self.cause = index, key, cause
        super().__init__(f"sample {index}, column '{key}': {cause}")


@dataclass(frozen=True)
class MediaRef:
    """One media item by reference: where its bytes are, their checksum, and small metadata."""

    modality: str
    """The modality plugin that decodes it (image, audio, video, ...)."""
    key: str
    """The data column it came from (for error messages)."""
    path: str
    """A local file or folder holding the encoded item (never the decoded array)."""
    sha256: str
    """Checksum of the bytes at ``path`` (a folder: of its files' names and bytes, in name order)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Small numbers the plugin reported when it checked the item (size, duration, frames)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> MediaRef:
        return cls(**value)


def dumps_context(prompt: str, refs: list[MediaRef], tokens_given: bool = False) -> str:
    """A sample's multimodal context (its prompt text and media references) as one JSON string:
    the value of the bus's ``media`` column. ``tokens_given``: the row's tokens are final (an
    agentic trajectory, whose ``refs`` are all its media in token order): a trainer rebuilds only
    the media tensors from them, never the tokens."""
    value: dict[str, Any] = {"prompt": prompt, "refs": [r.to_dict() for r in refs]}
    if tokens_given:
        value["tokens_given"] = True
    return json.dumps(value, sort_keys=True)


def context_gives_tokens(text: str) -> bool:
    """Whether a ``media`` column entry is an agentic trajectory's (``dumps_context(tokens_given=True)``)."""
    return bool(json.loads(text).get("tokens_given", False))


def loads_context(text: str) -> tuple[str, list[MediaRef]]:
    """The inverse of ``dumps_context``."""
    value = json.loads(text)
    return str(value["prompt"]), [MediaRef.from_dict(r) for r in value["refs"]]


def sha256_path(path: str | Path) -> str:
    """Checksum of a file's bytes, or of a folder's files (names and bytes, in name order)."""
    path = Path(path)
    digest = hashlib.sha256()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def spill(data: bytes, suffix: str, folder: str | Path) -> Path:
    """Write ``data`` once to ``<folder>/<sha256><suffix>`` (atomically; a second call with the
    same bytes finds the file) and return its path: how inline items get a reference."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{hashlib.sha256(data).hexdigest()}{suffix}"
    if not target.exists():
        fd, tmp = tempfile.mkstemp(prefix=".spill-", dir=folder)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, target)
    return target


def media_items(value: Any) -> list[Any]:
    """The items of a media cell: none (``None``), one item, or a list of items. An inline array
    given as nested lists is one item, not a list of items: a list counts as several items only
    when its entries are themselves paths, bytes or arrays (objects with a ``shape``)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, (str, bytes, os.PathLike)) or hasattr(v, "shape") for v in value):
        return list(value)
    return [value]


def resolve_path(item: str | os.PathLike, base_dir: str | Path | None) -> Path:
    """A path item as an absolute path (relative paths are taken from ``base_dir``)."""
    path = Path(item).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return path


class MediaSet:
    """The run's modality plugins, and how a data row's media cells become references.

    Built from the spec in every process that touches media (the rollout to make references, the
    trainer to decode them): each modality of ``data.media_keys`` gets its ``relax.modalities``
    plugin with the options of ``data.media_options.<modality>``.
    """

    def __init__(self, media_keys: dict[str, str], options: dict[str, dict[str, Any]],
                 base_dir: str | Path | None = None, spill_dir: str | Path | None = None,
                 on_bad_sample: str = "error") -> None:
        from relax.contracts import PluginKind
        from relax.registry import get_registry

        registry = get_registry()
        self.keys = dict(media_keys)
        self.plugins = {m: registry.load(PluginKind.modalities, m)(
            registry.build_config(PluginKind.modalities, m, dict(options.get(m, {})))) for m in self.keys}
        self.base_dir = base_dir
        self.spill_dir = spill_dir
        self.on_bad_sample = on_bad_sample
        """``data.on_bad_sample``: what a row with bad media does (``error`` or ``skip``)."""
        self.skipped = 0
        """Rows skipped for bad media so far (under ``skip``)."""

    @classmethod
    def from_spec(cls, spec: Any, base_dir: str | Path | None = None,
                  spill_dir: str | Path | None = None) -> MediaSet | None:
        """The spec's media set, or None when the data has no media columns."""
        if not spec.data.media_keys:
            return None
        return cls(spec.data.media_keys, spec.data.media_options, media_base_dir(spec, base_dir), spill_dir,
                   spec.data.on_bad_sample)

    @classmethod
    def from_info(cls, info: Any, base_dir: str | Path | None = None,
                  spill_dir: str | Path | None = None) -> MediaSet | None:
        """The media set of a plugin context's plain data (``relax.contracts.MediaInfo``: ``keys``,
        ``options``, ``on_bad_sample``), or None when there is none (a text run): how backends
        build theirs without reading the spec."""
        if info is None or not info.keys:
            return None
        return cls(info.keys, info.options, base_dir, spill_dir, info.on_bad_sample)

    def refs(self, row: dict[str, Any], index: int | str) -> list[MediaRef]:
        """References to every media item of a data row, each decoded and checked once.

        Raises ``BadSample`` naming the row and the column when an item is missing, undecodable
        or over budget. Inline items (bytes, arrays) are written once under ``spill_dir``."""
        refs = []
        for modality, key in self.keys.items():
            plugin = self.plugins[modality]
            for item in media_items(row.get(key)):
                try:
                    refs.append(self.reference(plugin, modality, key, item))
                except MediaError as exc:
                    raise BadSample(index, key, str(exc)) from None
                except Exception as exc:  # a plugin bug or an unexpected decoder error: still name the row
                    raise BadSample(index, key, f"{type(exc).__name__}: {exc}") from exc
        return refs

    def reference(self, plugin: Any, modality: str, key: str, item: Any) -> MediaRef:
        """One item's reference: its path (spilled first when inline), checksum and metadata."""
        if isinstance(item, (str, os.PathLike)):
            path = resolve_path(item, self.base_dir)
            loaded = plugin.load(path)
        else:
            if self.spill_dir is None:
                raise MediaError("an inline item needs a folder to be written to (no spill folder was given)")
            loaded = plugin.load(item)
            path = spill(plugin.encode(item), plugin.suffix, self.spill_dir)
        return MediaRef(modality=modality, key=key, path=str(path), sha256=sha256_path(path), meta=loaded.meta)

    def load(self, ref: MediaRef) -> Any:
        """The decoded view of a reference (its checksum verified first)."""
        return self.plugins[ref.modality].load(ref)


def media_base_dir(spec: Any, base_dir: str | Path | None) -> Path | None:
    """Where relative media paths of the training data are taken from: the data file's folder for a
    ``.jsonl``/``.parquet`` source, else the spec's folder."""
    source = Path(spec.data.train.source)
    if source.suffix.lower() in (".jsonl", ".json", ".parquet"):
        folder = source.parent if source.is_absolute() or base_dir is None else Path(base_dir) / source.parent
        return folder
    return Path(base_dir) if base_dir is not None else None
