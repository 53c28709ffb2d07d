"""``synthetic:omni``: small verifiable questions about an image, a sound or a video, built from a seed.

Three kinds of item, taken in turn (item ``i`` is of kind ``kinds[i % len(kinds)]``):

- image: a 32 x 32 picture filled with one colour (with a little noise); "Colour?" -> red, green
  or blue;
- audio: two 0.5 s tones one after the other at 16 kHz; "Higher tone?" -> first or second;
- video: 4 frames of 32 x 32, some showing a white dot; "Dot frames?" -> how many (1 to 4).

Media are written once as files (PNG, 16-bit WAV, ``.npy`` frames) under ``media_dir`` and the
rows hold their paths in the ``image``, ``audio`` and ``video`` columns (null for the other kinds),
so a run's ``data.media_keys`` is ``{image: image, audio: audio, video: video}``. With ``inline``
the rows hold the decoded arrays instead (what a data set without files looks like).
``builtin:tiny-omni`` is warmed up on exactly this task.

numpy and Pillow are imported inside the functions (``relax validate`` imports this module).
"""

from __future__ import annotations

import io
import os
import random
import tempfile
import wave
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from relax_plugins.datasets.seeded import item_rng

OmniKind = Literal["image", "audio", "video"]
COLOURS: dict[str, tuple[int, int, int]] = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 70, 220)}
SAMPLE_RATE = 16000
FRAMES = 4
SIDE = 32
PROMPTS = {"image": "Colour?", "audio": "Higher tone?", "video": "Dot frames?"}
#: Bumped when the generated media change, so old files are not reused.
MEDIA_VERSION = 1


def omni_problem(rng: random.Random, kind: str) -> dict[str, Any]:
    """One problem: ``{"kind", "prompt", "answer", "media"}`` with ``media`` a numpy array (an
    H x W x 3 image, a waveform, or T x H x W x 3 frames)."""
    import numpy as np

    noise = np.random.default_rng(rng.randrange(2**32))
    if kind == "image":
        name = rng.choice(sorted(COLOURS))
        pixels = np.array(COLOURS[name], dtype=np.int16) + noise.integers(-20, 21, size=(SIDE, SIDE, 3))
        return {"kind": kind, "prompt": PROMPTS[kind], "answer": name, "media": pixels.clip(0, 255).astype(np.uint8)}
    if kind == "audio":
        low = rng.uniform(200.0, 800.0)
        high = low * rng.uniform(1.8, 3.5)
        first_high = rng.random() < 0.5
        tones = (high, low) if first_high else (low, high)
        t = np.arange(SAMPLE_RATE // 2) / SAMPLE_RATE
        wave_ = np.concatenate([0.5 * np.sin(2 * np.pi * f * t) for f in tones]).astype(np.float32)
        return {"kind": kind, "prompt": PROMPTS[kind], "answer": "first" if first_high else "second", "media": wave_}
    if kind == "video":
        count = rng.randint(1, FRAMES)
        shown = set(rng.sample(range(FRAMES), count))
        frames = np.zeros((FRAMES, SIDE, SIDE, 3), dtype=np.uint8)
        for f in shown:
            y, x = rng.randint(0, SIDE - 12), rng.randint(0, SIDE - 12)
            frames[f, y:y + 12, x:x + 12] = 255
        return {"kind": kind, "prompt": PROMPTS[kind], "answer": str(count), "media": frames}
    raise ValueError(f"unknown omni item kind '{kind}'; use image, audio or video")


def encode_media(kind: str, array: Any) -> tuple[bytes, str]:
    """File bytes and suffix of a problem's media: PNG, 16-bit mono WAV, or ``.npy`` frames."""
    import numpy as np

    if kind == "image":
        from PIL import Image

        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="PNG")
        return buffer.getvalue(), ".png"
    if kind == "audio":
        buffer = io.BytesIO()
        with wave.open(buffer, "wb") as clip:
            clip.setnchannels(1)
            clip.setsampwidth(2)
            clip.setframerate(SAMPLE_RATE)
            clip.writeframes((np.clip(array, -1, 1) * 32767).round().astype("<i2").tobytes())
        return buffer.getvalue(), ".wav"
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue(), ".npy"


def default_media_dir() -> str:
    """``$RELAX_CACHE/omni-media`` (default ``~/.cache/relax/omni-media``)."""
    root = os.environ.get("RELAX_CACHE") or str(Path.home() / ".cache" / "relax")
    return str(Path(root) / "omni-media")


class OmniDataset:
    """A map-style data set of image, audio and video questions; item ``i`` depends only on the
    seed and ``i``, and its media file is written the first time any process asks for it."""

    #: The columns of every row; the media columns of the other kinds are null (``relax validate``
    #: checks the spec's data keys against them).
    columns: ClassVar[tuple[str, ...]] = ("prompt", "answer", "kind", "image", "audio", "video")

    class Config(BaseModel):
        """Options of the synthetic omni data set."""

        model_config = ConfigDict(extra="forbid")

        size: int = Field(3000, ge=1)
        """Number of problems."""
        seed: int = Field(0, ge=0)
        """Seed of the problems (item i is the same for the same seed, in every process)."""
        kinds: list[OmniKind] = Field(default_factory=lambda: ["image", "audio", "video"], min_length=1)
        """Kinds of item, taken in turn."""
        media_dir: str | None = None
        """Folder for the media files; null: ``$RELAX_CACHE/omni-media``."""
        inline: bool = False
        """Give the media as inline arrays in the rows instead of file paths."""

    @classmethod
    def length(cls, config: OmniDataset.Config) -> int:
        """The size of the set ``config`` builds, known without building it (``trainer.epochs``)."""
        return config.size

    def __init__(self, config: OmniDataset.Config) -> None:
        self.config = config
        self.folder = Path(config.media_dir or default_media_dir()).expanduser() / f"v{MEDIA_VERSION}-seed{config.seed}"

    def __len__(self) -> int:
        return self.config.size

    def problem(self, index: int) -> dict[str, Any]:
        kinds = self.config.kinds
        index, rng = item_rng("omni", self.config.seed, self.config.size, index)
        return {"index": index, **omni_problem(rng, kinds[index % len(kinds)])}

    def __getitem__(self, index: int) -> dict[str, Any]:
        problem = self.problem(index)
        kind = problem["kind"]
        row: dict[str, Any] = {"prompt": problem["prompt"], "answer": problem["answer"], "kind": kind,
                               "image": None, "audio": None, "video": None}
        if self.config.inline:
            row[kind] = problem["media"]
            return row
        data, suffix = encode_media(kind, problem["media"])
        path = self.folder / f"{kind}-{problem['index']}{suffix}"
        if not path.is_file():
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=self.folder)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, path)  # atomic: a reader never sees half a file
        row[kind] = str(path)
        return row
