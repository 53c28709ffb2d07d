"""A Qwen3-Omni processor that loads without torchvision: the processor of ``builtin:tiny-omni``.

transformers 5.19 ships no video processor that works without torchvision, and both
``Qwen3OmniMoeProcessor.from_pretrained`` and its argument check refuse to run without it
(measured in docs: FACTS-omni section 2). This module owns the two missing pieces:

- ``FrameVideoProcessor``: resizes each frame with Pillow by the Qwen smart-resize rule, rescales,
  normalises, pads the frame count to a multiple of ``temporal_patch_size`` by repeating the last
  frame, and emits ``pixel_values_videos`` in the Qwen patch order plus ``video_grid_thw``. A still
  clip gives exactly the image processor's output for that image.
- ``RelaxOmniProcessor``: ``Qwen3OmniMoeProcessor`` with an argument check that accepts it and a
  ``from_pretrained`` that loads the pieces of a folder itself.

Importing this module registers ``RelaxOmniProcessor`` with ``AutoProcessor`` for the Qwen3-Omni
thinker config, so ``AutoProcessor.from_pretrained(folder)`` works on a tiny-omni folder. It imports
transformers at the top: import it inside methods only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoProcessor, AutoTokenizer, BatchFeature
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor
from transformers.video_processing_utils import VideoProcessorMixin

#: File of the video processor's settings in a model folder.
VIDEO_CONFIG = "relax_video_processor.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
#: Subfolder of the image processor's settings (the feature extractor's take preprocessor_config.json).
IMAGE_FOLDER = "image_processor"


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The Qwen-VL resize rule: sides are multiples of ``factor``, the area within the bounds, the
    aspect ratio kept as closely as possible."""
    import math

    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class FrameVideoProcessor(VideoProcessorMixin):
    """Videos given as frames (a (T, H, W, C) uint8 array or a list of HWC frames) to Qwen patches."""

    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, patch_size: int = 16, temporal_patch_size: int = 2, merge_size: int = 2,
                 image_mean: list[float] | None = None, image_std: list[float] | None = None,
                 size: dict[str, int] | None = None, **kwargs: Any) -> None:
        self.patch_size = patch_size
        self.temporal_patch_size = temporal_patch_size
        self.merge_size = merge_size
        self.image_mean = list(image_mean or [0.5, 0.5, 0.5])
        self.image_std = list(image_std or [0.5, 0.5, 0.5])
        self.size = dict(size or {"shortest_edge": 32 * 32, "longest_edge": 64 * 64 * 4})

    def settings(self) -> dict[str, Any]:
        return {"patch_size": self.patch_size, "temporal_patch_size": self.temporal_patch_size,
                "merge_size": self.merge_size, "image_mean": self.image_mean, "image_std": self.image_std,
                "size": self.size}

    def __call__(self, videos: Any, **kwargs: Any) -> BatchFeature:
        return self.preprocess(videos, **kwargs)

    def preprocess(self, videos: Any, size: dict[str, int] | None = None, return_tensors: Any = None,
                   **_: Any) -> BatchFeature:
        from PIL import Image

        size = size or self.size
        if isinstance(videos, np.ndarray) and videos.ndim == 4:
            videos = [videos]
        p, t, m = self.patch_size, self.temporal_patch_size, self.merge_size
        mean = np.asarray(self.image_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(self.image_std, dtype=np.float32)[:, None, None]
        patches, grids = [], []
        for video in videos:
            frames = [np.asarray(f) for f in video]
            height, width = frames[0].shape[:2]
            h, w = smart_resize(height, width, p * m, size["shortest_edge"], size["longest_edge"])
            out = []
            for frame in frames:
                image = Image.fromarray(frame.astype(np.uint8)).convert("RGB")
                if image.size != (w, h):
                    image = image.resize((w, h), Image.BICUBIC)
                pixels = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / 255.0
                out.append((pixels - mean) / std)
            while len(out) % t:
                out.append(out[-1])
            clip = np.stack(out)  # (T, C, H, W)
            gt, gh, gw = clip.shape[0] // t, h // p, w // p
            clip = clip.reshape(gt, t, 3, gh // m, m, p, gw // m, m, p)
            clip = clip.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
            patches.append(clip.reshape(gt * gh * gw, 3 * t * p * p))
            grids.append([gt, gh, gw])
        return BatchFeature({"pixel_values_videos": np.concatenate(patches, axis=0),
                             "video_grid_thw": np.asarray(grids, dtype=np.int64)}, tensor_type=return_tensors)


class RelaxOmniProcessor(Qwen3OmniMoeProcessor):
    """``Qwen3OmniMoeProcessor`` with the torchvision-free video processor above."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor":
            if not isinstance(argument, FrameVideoProcessor):
                raise TypeError(f"video_processor must be a FrameVideoProcessor, got {type(argument).__name__}")
            return FrameVideoProcessor
        return super().check_argument_for_proper_class(argument_name, argument)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, **kwargs: Any) -> RelaxOmniProcessor:
        folder = Path(pretrained_model_name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        image_processor = AutoImageProcessor.from_pretrained(folder / IMAGE_FOLDER, backend="pil")
        feature_extractor = AutoFeatureExtractor.from_pretrained(folder)
        video_processor = FrameVideoProcessor(**json.loads((folder / VIDEO_CONFIG).read_text()))
        template = folder / CHAT_TEMPLATE_FILE
        chat_template = template.read_text() if template.is_file() else None
        return cls(image_processor=image_processor, video_processor=video_processor,
                   feature_extractor=feature_extractor, tokenizer=tokenizer, chat_template=chat_template)

    def save_pretrained(self, save_directory: Any, **kwargs: Any) -> list[str]:
        """Every piece, plus ``processor_config.json`` naming this class (what ``AutoProcessor`` reads)."""
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save_pretrained(folder)
        # The image processor and the feature extractor both write preprocessor_config.json.
        self.image_processor.save_pretrained(folder / IMAGE_FOLDER)
        self.feature_extractor.save_pretrained(folder)
        (folder / VIDEO_CONFIG).write_text(json.dumps(self.video_processor.settings(), indent=2))
        if self.chat_template:
            (folder / CHAT_TEMPLATE_FILE).write_text(self.chat_template)
        (folder / "processor_config.json").write_text(json.dumps({"processor_class": type(self).__name__}, indent=2))
        return [str(folder)]


AutoProcessor.register(Qwen3OmniMoeThinkerConfig, RelaxOmniProcessor, exist_ok=True)
