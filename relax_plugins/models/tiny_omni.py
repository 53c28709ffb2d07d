"""``builtin:tiny-omni``: a tiny Qwen3-Omni thinker (text, image, audio, video) built locally.

``materialize`` writes a Hugging Face folder: a character-level tokenizer with the Qwen omni
special tokens, a chat template, the processor pieces (Pillow image processor, Whisper feature
extractor, the torchvision-free ``FrameVideoProcessor``, tied together by ``RelaxOmniProcessor``,
which ``AutoProcessor`` loads), and a ``Qwen3OmniMoeThinkerForConditionalGeneration`` of about
0.66 M parameters in the shape FACTS-omni recommends (MoE text of width 64, 2-layer vision and
audio towers).

The build gives the model a short supervised warm-up on the ``synthetic:omni`` task, like tiny-lm:
it learns the answers but, on purpose, to stop right after the answer only
``warmup_stop_probability`` of the time (the other targets ramble on), so RL with an exact-match
reward starts weak and has something real and quick to learn. Cached under
``<cache_dir>/tiny-omni-<hash of the config and recipe>``, built once even when several processes
ask at the same time.

Imports only pydantic and the standard library; the build lives in ``tiny_omni_build``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from relax_plugins.models.build_cache import recipe_fingerprint
from relax_plugins.models.tiny_lm import CHARSET

PAD, IM_START, IM_END, UNK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"
#: The Qwen omni media tokens, by the tokenizer attribute the processor reads.
MEDIA_TOKENS = {
    "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>", "audio_token": "<|audio_pad|>",
    "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
}
SPECIAL_TOKENS = (PAD, IM_START, IM_END, UNK, *MEDIA_TOKENS.values())
"""Special tokens, ids 0 to 10; every character of ``CHARSET`` is one more token."""
VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARSET)
RECIPE_FILES = ("models/tiny_omni.py", "models/tiny_omni_build.py", "models/omni_processor.py", "datasets/omni.py")


class TinyOmni:
    """A tiny omni-modal model for CPU tests and demos."""

    class Config(BaseModel):
        """Sizes, seed and warm-up of the built-in tiny omni model."""

        model_config = ConfigDict(extra="forbid")

        hidden_size: int = Field(64, ge=32)
        """Width of the text model and of both encoders' outputs."""
        num_layers: int = Field(2, ge=1, le=16)
        """Text decoder layers."""
        num_experts: int = Field(4, ge=1)
        """Routed experts per text layer."""
        warmup_steps: int = Field(250, ge=0)
        """Supervised warm-up steps on the synthetic omni task (0 leaves the random weights)."""
        warmup_batch_size: int = Field(24, ge=1)
        """Problems per warm-up step."""
        warmup_pool: int = Field(240, ge=3)
        """Distinct problems (media) the warm-up draws its batches from."""
        warmup_lr: float = Field(3e-3, gt=0.0)
        """AdamW learning rate of the warm-up."""
        warmup_stop_probability: float = Field(0.3, ge=0.0, le=1.0)
        """Share of warm-up targets that stop right after the answer; the others ramble on before
        stopping, so sampled exact-match accuracy starts low and RL can raise it."""
        seed: int = Field(0, ge=0)
        """Seed of the initial weights and of the warm-up problems."""

    def __init__(self, config: TinyOmni.Config) -> None:
        self.config = config

    def architecture(self) -> dict[str, Any]:
        """The numbers of ``relax.spec.architecture.ModelArchitecture``, without building anything."""
        c = self.config
        return {
            "name": "builtin:tiny-omni",
            "num_layers": c.num_layers,
            "hidden_size": c.hidden_size,
            "num_attention_heads": 2,
            "num_kv_heads": 1,
            "head_dim": 32,
            "intermediate_size": 2 * c.hidden_size,
            "vocab_size": VOCAB_SIZE,
            "tie_embeddings": False,
            "num_experts": c.num_experts,
            "experts_per_token": min(2, c.num_experts),
            "moe_intermediate_size": c.hidden_size,
            "encoder_params": 480_000,
            "modalities": ["text", "image", "audio", "video"],
        }

    def fingerprint(self) -> str:
        """A short hash of the config and of the recipe's source: the name of the cached folder."""
        here = Path(__file__).parent.parent
        return recipe_fingerprint(self.config.model_dump(), (here / name for name in RECIPE_FILES))

    def materialize(self, cache_dir: str) -> str:
        """The folder of the built model, building it first unless it is already cached."""
        from relax_plugins.models.build_cache import cached_build

        def build(staging: Path) -> dict[str, Any]:
            from relax_plugins.models.tiny_omni_build import build_tiny_omni

            return build_tiny_omni(self.config, staging)

        return cached_build(cache_dir, "tiny-omni", self.fingerprint(), self.config.model_dump(), build)
