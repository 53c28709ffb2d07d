"""Model architecture numbers, read without loading a model.

Validation checks parallel sizes against heads and layers, and the planner estimates memory from
these numbers. They come from a local folder's ``config.json``, from a card shipped with Relax for
hub models the presets use (``relax/spec/cards/*.json``: numbers only, no weights), or from a
built-in model plugin's ``architecture()``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field

from relax.spec.attribute_docs import DocumentedModel

CARDS_DIR = Path(__file__).with_name("cards")
BUILTIN_PREFIX = "builtin:"


class ModelArchitecture(DocumentedModel):
    """The numbers of a decoder-only transformer (dense or mixture-of-experts) plus encoders."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    """Model name or id the numbers describe."""
    num_layers: int = Field(ge=1)
    """Decoder layers."""
    hidden_size: int = Field(ge=1)
    """Model width."""
    num_attention_heads: int = Field(ge=1)
    """Query heads."""
    num_kv_heads: int = Field(ge=1)
    """Key/value heads (grouped-query attention)."""
    head_dim: int = Field(ge=1)
    """Width of one head."""
    intermediate_size: int = Field(ge=0)
    """Width of a dense SwiGLU MLP (unused when every layer is MoE)."""
    vocab_size: int = Field(ge=1)
    """Vocabulary size."""
    tie_embeddings: bool = False
    """Whether the output head shares the input embedding."""
    num_experts: int = Field(0, ge=0)
    """Routed experts per MoE layer; 0 for a dense model."""
    experts_per_token: int = Field(0, ge=0)
    """Experts each token is routed to."""
    moe_intermediate_size: int = Field(0, ge=0)
    """Width of one expert's SwiGLU MLP."""
    encoder_params: int = Field(0, ge=0)
    """Parameters of vision/audio encoders and projectors (trained with the decoder)."""
    modalities: tuple[str, ...] = ("text",)
    """Inputs the model reads."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def attention_params(self) -> int:
        """q, k, v and o projections of one layer (biases and q/k norms are negligible)."""
        q = self.hidden_size * self.num_attention_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        o = self.num_attention_heads * self.head_dim * self.hidden_size
        return q + kv + o

    def expert_params(self) -> int:
        """All routed experts of one layer (SwiGLU: gate, up and down)."""
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def mlp_params(self) -> int:
        """The MLP of one layer: the experts plus router for MoE, a SwiGLU otherwise."""
        if self.is_moe:
            return self.expert_params() + self.hidden_size * self.num_experts
        return 3 * self.hidden_size * self.intermediate_size

    def embedding_params(self) -> int:
        """Input embedding plus the output head when untied."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)

    def params_total(self) -> int:
        """All parameters: P = L (attn + mlp + 2h) + embeddings + h + encoders."""
        per_layer = self.attention_params() + self.mlp_params() + 2 * self.hidden_size
        return (
            self.num_layers * per_layer
            + self.embedding_params()
            + self.hidden_size
            + self.encoder_params
        )

    def params_active(self) -> int:
        """Parameters a token passes through (MoE: only its routed experts)."""
        if not self.is_moe:
            return self.params_total()
        unused = self.num_experts - self.experts_per_token
        return self.params_total() - self.num_layers * unused * 3 * self.hidden_size * self.moe_intermediate_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache of one token over all layers: 2 (k and v) x L x kv_heads x head_dim x bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


class ArchitectureError(ValueError):
    """The architecture could not be read; the message says what to fix."""


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    for path in (("thinker_config", "text_config"), ("text_config",), ("llm_config",)):
        node: Any = config
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and "hidden_size" in node:
            return node
    return config


def _encoder_params(config: dict[str, Any]) -> tuple[int, list[str]]:
    """Rough size of vision/audio towers from their configs: depth x (4h^2 + 2 h i)."""
    root = config.get("thinker_config", config)
    total, modalities = 0, []
    for key, kinds in (("vision_config", ["image", "video"]), ("audio_config", ["audio"])):
        tower = root.get(key) if isinstance(root, dict) else None
        if not isinstance(tower, dict):
            continue
        modalities += kinds
        depth = tower.get("depth") or tower.get("num_hidden_layers") or tower.get("encoder_layers") or 0
        width = tower.get("hidden_size") or tower.get("embed_dim") or tower.get("d_model") or 0
        inner = tower.get("intermediate_size") or tower.get("encoder_ffn_dim") or 4 * width
        total += int(depth) * (4 * width * width + 2 * width * inner)
    return total, modalities


def architecture_from_hf_config(config: dict[str, Any], name: str) -> ModelArchitecture:
    """Read the numbers from a Hugging Face ``config.json`` (Llama, Qwen2/3, Qwen MoE, VL, Omni)."""
    text = _text_config(config)
    try:
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        encoder, extra = _encoder_params(config)
        return ModelArchitecture(
            name=name,
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            intermediate_size=int(text.get("intermediate_size") or 0),
            vocab_size=int(text["vocab_size"]),
            tie_embeddings=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
            num_experts=int(text.get("num_experts") or text.get("num_local_experts")
                            or text.get("n_routed_experts") or 0),
            experts_per_token=int(text.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
            encoder_params=encoder,
            modalities=("text", *extra),
        )
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ArchitectureError(
            f"config.json of {name} lacks a usable {exc}; give a decoder config with "
            "hidden_size, num_attention_heads, num_hidden_layers and vocab_size"
        ) from exc


def load_card(model_id: str) -> ModelArchitecture | None:
    """The shipped card for a hub id (case-insensitive), or None."""
    wanted = model_id.lower()
    for card in CARDS_DIR.glob("*.json"):
        data = json.loads(card.read_text())
        if data["name"].lower() == wanted:
            return ModelArchitecture.model_validate(data)
    return None


def shipped_cards() -> list[str]:
    """Hub ids with a shipped card."""
    return sorted(json.loads(p.read_text())["name"] for p in CARDS_DIR.glob("*.json"))
