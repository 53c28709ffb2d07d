"""``video``: clips as frames, without a video decoder: a ``.npy`` array (T, H, W, C) uint8, a
folder of image frames (taken in name order), or an inline array.

A frame array carries no timing, so the clip is taken to be sampled at ``fps``, which is also what
the processor is told (it sets the temporal positions of the video tokens). Budgets: ``max_frames``,
``max_seconds`` and ``max_pixels`` per frame; an empty clip is a bad sample. ``frame_min_pixels``
and ``frame_max_pixels`` bound the processor's resize of each frame (the processor-level default
of the Qwen omni family would upscale a small frame many times over).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from relax.media import MediaError
from relax_plugins.modalities.base import Loaded, ModalityPlugin, as_array, load_npy, npy_bytes, probe_npy
from relax_plugins.modalities.image import open_image

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")


class VideoModality(ModalityPlugin):
    """Decodes frame arrays or frame folders into one (T, H, W, 3) uint8 array."""

    modality: ClassVar[str] = "video"
    accepts_folders: ClassVar[bool] = True
    processor_argument: ClassVar[str] = "videos"
    suffix: ClassVar[str] = ".npy"

    class Config(BaseModel):
        """Frame rate and size budgets of video inputs."""

        model_config = ConfigDict(extra="forbid")

        fps: float = Field(2.0, gt=0.0)
        """Frames per second of the stored frames (and what the processor is told)."""
        max_frames: int = Field(64, ge=1)
        """Most frames in one clip; a longer clip is a bad sample."""
        max_seconds: float = Field(60.0, gt=0.0)
        """Longest clip in seconds (frames / fps)."""
        max_pixels: int = Field(1024 * 1024, ge=1)
        """Largest frame in pixels (width x height)."""
        frame_min_pixels: int = Field(32 * 32, ge=1)
        """Smallest frame area after the processor's resize."""
        frame_max_pixels: int = Field(64 * 64 * 4, ge=1)
        """Largest frame area after the processor's resize."""

    def decode_path(self, path: Path) -> Loaded:
        if path.is_dir():
            return self._from_frames(path)
        return self.decode_bytes(path.read_bytes(), where=str(path))

    def decode_bytes(self, data: bytes, where: str = "video") -> Loaded:
        return self.decode_array(load_npy(data, where))

    def _from_frames(self, folder: Path) -> Loaded:
        import numpy as np

        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)
        if not files:
            raise MediaError(f"{folder} holds no frames ({', '.join(FRAME_SUFFIXES)} files)")
        frames = []
        for file in files:
            try:
                with open_image(file, self.config.max_pixels, what=f"frame {file}") as image:
                    frames.append(np.asarray(image.convert("RGB")))
            except MediaError as exc:
                message = str(exc)
                raise MediaError(message if message.startswith("frame") else f"frame {file} {message}") from None
        if len({f.shape for f in frames}) > 1:
            raise MediaError(f"the frames in {folder} differ in size; give every frame the same size")
        return self.decode_array(np.stack(frames))

    def decode_array(self, item: Any) -> Loaded:
        import numpy as np

        array = as_array(item, "video")
        if array.size == 0:
            raise MediaError(f"the video is empty (shape {array.shape})")
        if array.ndim == 3:
            array = array[..., None]
        if array.ndim != 4 or array.shape[-1] not in (1, 3, 4):
            raise MediaError(f"a video must be T x H x W x C with C in 1, 3, 4; got shape {array.shape}")
        if array.dtype.kind == "f":
            array = (array.clip(0.0, 1.0) * 255).round()
        array = array.astype(np.uint8)
        if array.shape[-1] == 1:
            array = array.repeat(3, axis=-1)
        return Loaded(np.ascontiguousarray(array[..., :3]))

    def encode_array(self, item: Any) -> bytes:
        return npy_bytes(self.decode_array(item).data)

    def check(self, loaded: Loaded) -> Loaded:
        c = self.config
        frames, height, width = loaded.data.shape[:3]
        seconds = frames / c.fps
        if frames > c.max_frames:
            raise MediaError(f"video of {frames} frames is over max_frames={c.max_frames}; sample fewer frames, "
                             "or raise data.media_options.video.max_frames")
        if seconds > c.max_seconds:
            raise MediaError(f"video of {seconds:.1f} s ({frames} frames at {c.fps} fps) is over max_seconds="
                             f"{c.max_seconds}")
        if width * height > c.max_pixels:
            raise MediaError(f"video frames of {width}x{height} are over max_pixels={c.max_pixels}")
        loaded.meta = {"frames": frames, "width": width, "height": height, "fps": c.fps}
        return loaded

    def processor_kwargs(self) -> dict[str, Any]:
        c = self.config
        return {"videos_kwargs": {"fps": c.fps, "size": {"shortest_edge": c.frame_min_pixels,
                                                         "longest_edge": c.frame_max_pixels}}}

    def probe(self, path: Path) -> str | None:
        if path.is_dir():
            if not any(p.suffix.lower() in FRAME_SUFFIXES for p in path.iterdir()):
                return "is a folder without frames"
            return None
        return probe_npy(path)
