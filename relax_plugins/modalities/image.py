"""``image``: still images (PNG, JPEG, ... through Pillow, or an inline HxWxC uint8 array).

Budgets: ``max_pixels`` (width x height of the decoded image) and ``max_tokens`` (the image's
placeholder tokens, estimated as ``ceil(h / s) * ceil(w / s)`` with ``s = token_side``, 32 for the
Qwen-VL and Qwen-Omni families: patch 16 merged 2 x 2). An image over either is a bad sample.

The pixel budget is checked on the size the file's header announces, before a single pixel is
decoded (``open_image``): a small PNG can announce 10000 x 10000 pixels, 300 MB once decoded.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from relax.media import MediaError
from relax_plugins.modalities.base import Loaded, ModalityPlugin, as_array

#: Leading bytes of the formats ``probe`` recognises, and the bytes a complete file ends with.
_SIGNATURES = {
    b"\x89PNG\r\n\x1a\n": ("PNG", b"IEND\xaeB`\x82"),
    b"\xff\xd8\xff": ("JPEG", b"\xff\xd9"),
    b"GIF87a": ("GIF", b";"),
    b"GIF89a": ("GIF", b";"),
    b"BM": ("BMP", None),
    b"RIFF": ("WebP", None),
}


def open_image(source: bytes | Path, max_pixels: int, what: str = "image") -> Any:
    """The decoded image of ``source`` (the bytes of a file, or its path), refused with a
    ``MediaError`` before decoding when its header announces more than ``max_pixels`` pixels.

    Pillow reads only the header in ``Image.open``; ``load`` decodes. Pillow's own guard against
    decompression bombs (a warning past ``Image.MAX_IMAGE_PIXELS``, an error past twice that) would
    otherwise fire first, as a warning or an exception that is not a ``MediaError``; the budget here
    is the spec's, so the guard is silenced for this call and its error reported as one."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
            width, height = image.size
            if width * height > max_pixels:
                image.close()
                raise MediaError(f"{what} of {width}x{height} = {width * height} pixels is over max_pixels="
                                 f"{max_pixels} (read from its header, not decoded); resize it, or raise "
                                 "the modality's max_pixels in data.media_options")
            image.load()  # decodes every pixel: a truncated file fails here, not later
    except Image.DecompressionBombError as exc:
        raise MediaError(f"{what} is refused as a decompression bomb ({exc})") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        if isinstance(exc, MediaError):
            raise
        raise MediaError(f"is not a decodable image ({exc})") from None
    return image


class ImageModality(ModalityPlugin):
    """Decodes images with Pillow into RGB, within the pixel and token budgets."""

    modality: ClassVar[str] = "image"
    processor_argument: ClassVar[str] = "images"
    suffix: ClassVar[str] = ".png"

    class Config(BaseModel):
        """Budgets of image inputs."""

        model_config = ConfigDict(extra="forbid")

        max_pixels: int = Field(1024 * 1024, ge=1)
        """Largest image in pixels (width x height); a larger one is a bad sample."""
        max_tokens: int = Field(1024, ge=1)
        """Most placeholder tokens one image may take (estimated with ``token_side``)."""
        token_side: int = Field(32, ge=1)
        """Side in pixels of the square one image token covers (patch size x merge size)."""
        min_side: int = Field(1, ge=1)
        """Shortest allowed side in pixels."""

    def decode_bytes(self, data: bytes) -> Loaded:
        return Loaded(open_image(data, self.config.max_pixels).convert("RGB"))

    def decode_path(self, path: Path) -> Loaded:
        try:
            return self.decode_bytes(path.read_bytes())
        except MediaError as exc:
            raise MediaError(f"{path} {exc}") from None

    def decode_array(self, item: Any) -> Loaded:
        from PIL import Image

        array = as_array(item, "image")
        if array.ndim == 2:
            array = array[..., None].repeat(3, axis=-1)
        if array.ndim != 3 or array.shape[-1] not in (1, 3, 4):
            raise MediaError(f"an inline image must be H x W x C with C in 1, 3, 4; got shape {array.shape}")
        if array.dtype.kind == "f":
            array = (array.clip(0.0, 1.0) * 255).round()
        if array.shape[-1] == 1:
            array = array.repeat(3, axis=-1)
        return Loaded(Image.fromarray(array.astype("uint8")).convert("RGB"))

    def encode_array(self, item: Any) -> bytes:
        buffer = io.BytesIO()
        self.decode_array(item).data.save(buffer, format="PNG")
        return buffer.getvalue()

    def check(self, loaded: Loaded) -> Loaded:
        c = self.config
        width, height = loaded.data.size
        if min(width, height) < c.min_side:
            raise MediaError(f"image of {width}x{height} has a side under min_side={c.min_side}")
        if width * height > c.max_pixels:
            raise MediaError(f"image of {width}x{height} = {width * height} pixels is over max_pixels="
                             f"{c.max_pixels}; resize it, or raise data.media_options.image.max_pixels")
        tokens = math.ceil(width / c.token_side) * math.ceil(height / c.token_side)
        if tokens > c.max_tokens:
            raise MediaError(f"image of {width}x{height} takes about {tokens} tokens, over max_tokens="
                             f"{c.max_tokens}; resize it, or raise data.media_options.image.max_tokens")
        loaded.meta = {"width": width, "height": height, "tokens": tokens}
        return loaded

    def probe(self, path: Path) -> str | None:
        with open(path, "rb") as handle:
            head = handle.read(16)
            handle.seek(max(0, path.stat().st_size - 16))
            tail = handle.read()
        for magic, (name, end) in _SIGNATURES.items():
            if head.startswith(magic):
                if end is not None and not tail.rstrip(b"\0").endswith(end):
                    return f"is a truncated {name} (it does not end with the {name} end marker)"
                return None
        return "is not an image file Relax recognises (PNG, JPEG, GIF, BMP or WebP)"
