"""``audio``: sound clips (WAV through the standard library's ``wave``, ``.npy`` waveforms, or an
inline 1-D array at ``sample_rate``).

The view handed to the processor is a float32 mono waveform in [-1, 1] at ``sample_rate`` (what a
Whisper-style feature extractor takes). Budgets: ``max_seconds`` and ``min_seconds``; a clip at
another sample rate is resampled (linear interpolation) unless ``resample`` is false, when it is a
bad sample.
"""

from __future__ import annotations

import io
import wave
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from relax.media import MediaError
from relax_plugins.modalities.base import Loaded, ModalityPlugin, as_array, load_npy, probe_npy


class AudioModality(ModalityPlugin):
    """Decodes WAV / ``.npy`` audio into a mono float32 waveform at the model's sample rate."""

    modality: ClassVar[str] = "audio"
    processor_argument: ClassVar[str] = "audio"
    suffix: ClassVar[str] = ".wav"

    class Config(BaseModel):
        """Sample rate and duration budgets of audio inputs."""

        model_config = ConfigDict(extra="forbid")

        sample_rate: int = Field(16000, ge=1000)
        """Sample rate the model's feature extractor expects (Hz); inline arrays and ``.npy``
        files are taken to be at this rate."""
        resample: bool = True
        """Resample clips recorded at another rate; false makes such a clip a bad sample."""
        max_seconds: float = Field(30.0, gt=0.0)
        """Longest clip in seconds; a longer one is a bad sample."""
        min_seconds: float = Field(0.01, ge=0.0)
        """Shortest clip in seconds (an empty or near-empty clip is a bad sample)."""

    def decode_path(self, path: Path) -> Loaded:
        data = path.read_bytes()
        if path.suffix.lower() == ".npy":
            return self.decode_array(load_npy(data, f"audio file {path}"))
        try:
            return self.decode_bytes(data)
        except MediaError as exc:
            raise MediaError(f"{path} {exc}") from None

    def decode_bytes(self, data: bytes) -> Loaded:
        import numpy as np

        try:
            with wave.open(io.BytesIO(data), "rb") as clip:
                channels, width, rate, frames = (clip.getnchannels(), clip.getsampwidth(), clip.getframerate(),
                                                  clip.getnframes())
                raw = clip.readframes(frames)
        except (wave.Error, EOFError, OSError) as exc:
            raise MediaError(f"is not a readable WAV file ({exc})") from None
        got = len(raw) // max(1, channels * width)
        if got < frames:
            raise MediaError(f"is a truncated WAV file: its header announces {frames} frames, it holds {got}")
        if width == 1:
            samples = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
        elif width in (2, 4):
            dtype = np.int16 if width == 2 else np.int32
            samples = np.frombuffer(raw, dtype=dtype).astype(np.float32) / float(np.iinfo(dtype).max)
        else:
            raise MediaError(f"has {8 * width}-bit samples; use 8, 16 or 32-bit PCM WAV")
        samples = samples.reshape(-1, channels).mean(axis=1)
        return self._at_rate(samples, rate)

    def decode_array(self, item: Any) -> Loaded:
        import numpy as np

        array = as_array(item, "audio")
        if array.ndim == 2 and 1 in array.shape:
            array = array.reshape(-1)
        if array.ndim != 1:
            raise MediaError(f"an inline audio clip must be a 1-D waveform; got shape {array.shape}")
        if array.dtype.kind in "iu":
            array = array.astype(np.float32) / float(np.iinfo(array.dtype).max)
        return self._at_rate(array.astype(np.float32), self.config.sample_rate)

    def _at_rate(self, samples: Any, rate: int) -> Loaded:
        import numpy as np

        want = self.config.sample_rate
        if rate != want:
            if not self.config.resample:
                raise MediaError(f"is recorded at {rate} Hz but the model takes {want} Hz (resample is off)")
            if len(samples):
                count = max(1, round(len(samples) * want / rate))
                samples = np.interp(np.linspace(0, len(samples) - 1, count), np.arange(len(samples)),
                                    samples).astype(np.float32)
        return Loaded(np.ascontiguousarray(samples, dtype=np.float32), {"source_rate": rate})

    def encode_array(self, item: Any) -> bytes:
        import numpy as np

        samples = self.decode_array(item).data
        pcm = (np.clip(samples, -1.0, 1.0) * 32767).round().astype("<i2")
        buffer = io.BytesIO()
        with wave.open(buffer, "wb") as clip:
            clip.setnchannels(1)
            clip.setsampwidth(2)
            clip.setframerate(self.config.sample_rate)
            clip.writeframes(pcm.tobytes())
        return buffer.getvalue()

    def check(self, loaded: Loaded) -> Loaded:
        c = self.config
        seconds = len(loaded.data) / c.sample_rate
        if seconds < c.min_seconds or len(loaded.data) == 0:
            raise MediaError(f"audio clip of {seconds:.3f} s is shorter than min_seconds={c.min_seconds}")
        if seconds > c.max_seconds:
            raise MediaError(f"audio clip of {seconds:.2f} s is longer than max_seconds={c.max_seconds}; cut it, "
                             "or raise data.media_options.audio.max_seconds")
        loaded.meta = {**loaded.meta, "seconds": round(seconds, 4), "sample_rate": c.sample_rate}
        return loaded

    def processor_kwargs(self) -> dict[str, Any]:
        return {"audio_kwargs": {"sampling_rate": self.config.sample_rate}}

    def probe(self, path: Path) -> str | None:
        if path.suffix.lower() == ".npy":
            return probe_npy(path)
        try:
            with wave.open(str(path), "rb") as clip:
                frames, block = clip.getnframes(), clip.getnchannels() * clip.getsampwidth()
                got = len(clip.readframes(frames)) // max(1, block)
        except (wave.Error, EOFError, OSError) as exc:
            return f"is not a readable WAV file ({exc})"
        if got < frames:
            return f"is a truncated WAV file: its header announces {frames} frames, it holds {got}"
        if frames == 0:
            return "is an empty WAV file (0 frames)"
        return None
