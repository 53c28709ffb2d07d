"""What the image, audio and video plugins share: turning a media item into a checked, decoded view.

A media item in a data set is a path (a file, or a folder of frames for video), the encoded bytes
of a file, or an inline array (a numpy array or nested lists). ``load`` accepts any of these, or a
``relax.media.MediaRef`` (then the bytes at its path must still hash to its checksum), decodes it,
checks it against the plugin's budgets and returns a ``Loaded`` view in the form the model's
processor takes. ``encode`` turns a non-path item into file bytes so it can travel by reference.

Imports only pydantic and the standard library at module level (``relax validate`` reads the
``Config`` of every plugin); numpy and Pillow are imported inside the methods.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from relax.media import MediaError, MediaRef, sha256_path


@dataclass
class Loaded:
    """A decoded, checked media item."""

    data: Any
    """What the processor takes: a PIL image, a float32 mono waveform, a (T, H, W, C) uint8 array."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Small numbers worth carrying in the reference (sizes, duration, frame count)."""


class ModalityPlugin:
    """Base of the built-in modality plugins (``relax.modalities``)."""

    modality: ClassVar[str]
    """The modality this plugin decodes (and the content type of a chat message item)."""
    processor_argument: ClassVar[str]
    """The keyword of a Hugging Face multimodal processor call that takes this media."""
    suffix: ClassVar[str]
    """File suffix of ``encode``'s bytes (how an inline item is written to travel by reference)."""
    accepts_folders: ClassVar[bool] = False
    """Whether an item may be a folder (video's folder of frames); for the others a folder is a bad
    item, named as such, not an ``IsADirectoryError`` from reading it."""

    def __init__(self, config: Any) -> None:
        self.config = config

    # -- the contract ---------------------------------------------------------------------------

    def load(self, item: Any) -> Loaded:
        """Decode and check one item (a path, bytes, an inline array or a ``MediaRef``)."""
        if isinstance(item, MediaRef):
            path = Path(item.path)
            if not path.exists():
                raise MediaError(f"{item.path} is gone (it was there when the sample was generated)")
            actual = sha256_path(path)
            if actual != item.sha256:
                raise MediaError(f"{item.path} changed since the sample was generated (sha256 {actual[:12]}, "
                                 f"the reference says {item.sha256[:12]}); media must not change during a run")
            item = path
        if isinstance(item, (str, os.PathLike)):
            path = Path(item)
            if not path.exists():
                raise MediaError(f"{path} does not exist")
            if path.is_dir() and not self.accepts_folders:
                raise MediaError(f"{path} is a folder, not a {self.modality} file")
            if path.is_file() and path.stat().st_size == 0:
                raise MediaError(f"{path} is empty (0 bytes)")
            return self.check(self.decode_path(path))
        if isinstance(item, (bytes, bytearray, memoryview)):
            if not bytes(item):
                raise MediaError("the item is empty (0 bytes)")
            return self.check(self.decode_bytes(bytes(item)))
        return self.check(self.decode_array(item))

    def encode(self, item: Any) -> bytes:
        """File bytes of a non-path item (bytes are kept as they are; arrays are encoded)."""
        if isinstance(item, (bytes, bytearray, memoryview)):
            return bytes(item)
        return self.encode_array(item)

    def processor_kwargs(self) -> dict[str, Any]:
        """Extra keyword arguments of the processor call for this modality, grouped the way
        Hugging Face processors group them (``{"videos_kwargs": {...}}``); none by default."""
        return {}

    def probe(self, path: Path) -> str | None:
        """A cheap check of a file with the standard library only (``relax validate`` runs it on the
        media a data file names): the problem, or None if the file looks usable."""
        return None

    # -- per modality ---------------------------------------------------------------------------

    def decode_path(self, path: Path) -> Loaded:
        return self.decode_bytes(path.read_bytes())

    def decode_bytes(self, data: bytes) -> Loaded:
        raise NotImplementedError

    def decode_array(self, item: Any) -> Loaded:
        raise NotImplementedError

    def encode_array(self, item: Any) -> bytes:
        raise NotImplementedError

    def check(self, loaded: Loaded) -> Loaded:
        return loaded


def as_array(item: Any, what: str) -> Any:
    """An inline item as a numpy array (``MediaError`` for anything that is not array-like)."""
    import numpy as np

    try:
        array = np.asarray(item)
    except Exception as exc:  # ragged lists and the like
        raise MediaError(f"the inline {what} is not an array: {exc}") from None
    if array.dtype == object:
        raise MediaError(f"the inline {what} is not a numeric array (got {type(item).__name__})")
    return array


def npy_bytes(array: Any) -> bytes:
    """A numpy array as the bytes of a ``.npy`` file."""
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def load_npy(data: bytes, what: str) -> Any:
    """A ``.npy`` file's array; a truncated or foreign file is a ``MediaError``."""
    import numpy as np

    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as exc:
        raise MediaError(f"the {what} is not a readable .npy array ({exc}); it may be truncated") from None


def probe_npy(path: Path) -> str | None:
    """Stdlib check of a ``.npy`` file: the header parses and the file holds all the data it
    announces (a truncated or empty array is reported)."""
    import ast
    import math
    import struct

    try:
        with open(path, "rb") as handle:
            head = handle.read(10)
            if head[:6] != b"\x93NUMPY":
                return "is not a .npy file (bad magic bytes)"
            major = head[6]
            if major == 1:
                length = struct.unpack("<H", head[8:10])[0]
                offset = 10
            else:
                length = struct.unpack("<I", head[8:10] + handle.read(2))[0]
                offset = 12
            header = ast.literal_eval(handle.read(length).decode("latin1"))
    except (OSError, ValueError, SyntaxError, struct.error) as exc:
        return f"has an unreadable .npy header ({exc})"
    shape = tuple(header.get("shape", ()))
    descr = str(header.get("descr", ""))
    digits = "".join(ch for ch in descr if ch.isdigit())
    itemsize = int(digits) if digits else 1
    if any(n == 0 for n in shape):
        return f"holds an empty array (shape {shape})"
    expected = offset + length + math.prod(shape) * itemsize
    actual = path.stat().st_size
    if actual < expected:
        return f"is truncated: its header announces {expected} bytes, the file has {actual}"
    return None
