"""``builtin:tiny-lm``: a tiny Llama-style causal LM built locally from a seed (no download).

``materialize`` trains a character-level tokenizer with the ``tokenizers`` library, initialises a
small Llama (or Qwen2) model at random from ``seed`` and gives it a short supervised warm-up on the
``synthetic:arithmetic`` task. The warm-up teaches the answers but, on purpose, to stop right
after the answer only ``warmup_stop_probability`` of the time (the other targets ramble on), so
that reinforcement learning with an exact-match reward starts from a weak policy (about 0.25
sampled accuracy) and has something quick and real to learn (reaching about 0.85 within a few
dozen GRPO steps). The result is a normal Hugging Face folder (``save_pretrained``, safetensors,
tokenizer), cached under ``<cache_dir>/tiny-lm-<hash of the config>`` and built once even when
several processes ask at the same time.

This module imports only pydantic and the standard library; the build (torch, transformers) lives
in ``relax_plugins.models.tiny_lm_build`` and is imported by ``materialize``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: Source files whose text is part of the cache key: editing the recipe rebuilds the model.
RECIPE_FILES = ("tiny_lm.py", "tiny_lm_build.py")
#: Marker written last into a finished build; a folder without it is not a usable model.
BUILD_MARKER = "relax-build.json"

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<eos>", "<unk>")
"""Pad, end-of-sequence and unknown tokens, with ids 0, 1 and 2."""
CHARSET: tuple[str, ...] = ("\n", *(chr(code) for code in range(32, 127)))
"""Every character of the vocabulary: newline and printable ASCII (one token each)."""
VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARSET)


class TinyLM:
    """A tiny decoder-only LM for CPU tests and demos (about 100k parameters by default)."""

    class Config(BaseModel):
        """Sizes, task and warm-up of the built-in tiny model."""

        model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

        architecture: Literal["llama", "qwen2"] = "llama"
        """Hugging Face architecture of the model (both load in transformers and vLLM)."""
        num_layers: int = Field(2, ge=1, le=32)
        """Decoder layers."""
        hidden_size: int = Field(64, ge=8)
        """Model width (num_attention_heads x head_dim need not equal it)."""
        num_attention_heads: int = Field(2, ge=1)
        """Query heads."""
        num_kv_heads: int = Field(1, ge=1)
        """Key/value heads; must divide num_attention_heads."""
        head_dim: int = Field(32, ge=32)
        """Width of one head; at least 32 (vLLM's CPU attention rejects 16)."""
        intermediate_size: int = Field(256, ge=1)
        """Width of the SwiGLU MLP."""
        max_position_embeddings: int = Field(512, ge=16)
        """Longest sequence (prompt plus response) in tokens."""
        tie_embeddings: bool = True
        """Share the input embedding with the output head."""
        task: Literal["arithmetic"] = "arithmetic"
        """Task of the warm-up: ``arithmetic`` teaches the default ``synthetic:arithmetic`` format."""
        warmup_steps: int = Field(600, ge=0)
        """Supervised warm-up steps on the task (0 leaves the random initialisation)."""
        warmup_batch_size: int = Field(64, ge=1)
        """Problems per warm-up step."""
        warmup_lr: float = Field(3e-3, gt=0.0)
        """AdamW learning rate of the warm-up."""
        warmup_stop_probability: float = Field(0.3, ge=0.0, le=1.0)
        """Share of warm-up targets that stop right after the answer; the others ramble on (a space
        and a few random characters) before stopping. The model learns the answers well but to stop
        only this often, so its sampled exact-match accuracy starts near this value and RL can raise
        it by teaching it to stop. 1.0 teaches clean answers only."""
        seed: int = Field(0, ge=0)
        """Seed of the initial weights and of the warm-up problems."""

    def __init__(self, config: TinyLM.Config) -> None:
        if config.num_attention_heads % config.num_kv_heads:
            raise ValueError(f"tiny-lm: num_kv_heads {config.num_kv_heads} must divide "
                             f"num_attention_heads {config.num_attention_heads}")
        self.config = config

    def architecture(self) -> dict[str, Any]:
        """The numbers of ``relax.spec.architecture.ModelArchitecture``, without building anything."""
        c = self.config
        return {
            "name": "builtin:tiny-lm",
            "num_layers": c.num_layers,
            "hidden_size": c.hidden_size,
            "num_attention_heads": c.num_attention_heads,
            "num_kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "intermediate_size": c.intermediate_size,
            "vocab_size": VOCAB_SIZE,
            "tie_embeddings": c.tie_embeddings,
            "modalities": ["text"],
        }

    def fingerprint(self) -> str:
        """A short hash of the config and of the recipe's source: the name of the cached folder."""
        digest = hashlib.sha256(json.dumps(self.config.model_dump(), sort_keys=True).encode())
        here = Path(__file__).parent
        for name in RECIPE_FILES:
            digest.update((here / name).read_bytes())
        return digest.hexdigest()[:16]

    def materialize(self, cache_dir: str) -> str:
        """The folder of the built model, building it first unless it is already cached."""
        cache = Path(cache_dir).expanduser()
        cache.mkdir(parents=True, exist_ok=True)
        folder = cache / f"tiny-lm-{self.fingerprint()}"
        if (folder / BUILD_MARKER).is_file():
            return str(folder)
        with _exclusive(cache / f"{folder.name}.lock"):
            if (folder / BUILD_MARKER).is_file():  # another process built it while we waited
                return str(folder)
            from relax_plugins.models.tiny_lm_build import build_tiny_lm

            staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=cache))
            try:
                report = build_tiny_lm(self.config, staging)
                (staging / BUILD_MARKER).write_text(json.dumps(
                    {"fingerprint": self.fingerprint(), "config": self.config.model_dump(), **report}, indent=2))
                if folder.exists():  # a stale, unfinished folder (no marker) from a crash
                    shutil.rmtree(folder)
                os.replace(staging, folder)
            finally:
                if staging.exists():
                    shutil.rmtree(staging, ignore_errors=True)
        return str(folder)


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """An inter-process lock held while building (``fcntl.flock``; released if the process dies)."""
    import fcntl

    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
