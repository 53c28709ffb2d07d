"""LoRA on a trained role: the ``lora`` block of ``roles.actor`` / ``roles.critic`` and its checks.

With a ``lora`` block the role's trainer freezes the base model and trains low-rank adapters
(``peft``) on the named linear layers: only the adapter's parameters get gradients and optimizer
state, weight syncs move only the adapter, and checkpoints hold only the adapter and its optimizer
state (docs/lora.md).

Validation checks the target modules against the module names the model's architecture has,
without importing torch or building the model: the decoder layers of the Llama / Qwen family every
shipped card and built-in model belongs to (``decoder_module_names``). Imports only pydantic and
the standard library (``relax validate`` and ``relax plan`` import it).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from relax.contracts import ATTENTION_LINEARS, DENSE_MLP_LINEARS
from relax.spec.architecture import ModelArchitecture
from relax.spec.attribute_docs import DocumentedModel

ALL_LINEAR = "all-linear"
"""``target_modules`` for every linear layer of the decoder except the output head (peft's own
meaning of the name)."""

#: Modules that may be trained in full beside the adapter (``modules_to_save``): they are not
#: linear layers LoRA can wrap, or are the output head, which ``all-linear`` leaves out.
SAVABLE_MODULES = ("embed_tokens", "lm_head", "norm", "input_layernorm", "post_attention_layernorm")


class LoraSpec(DocumentedModel):
    """Train a LoRA adapter instead of the whole model (``peft``; docs/lora.md)."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    rank: int = Field(16, gt=0, le=4096)
    """Rank r of each adapter (its A is r x in, its B out x r)."""
    alpha: float = Field(32.0, gt=0.0)
    """Scale numerator: an adapter adds ``(alpha / rank) * B A x`` to its layer's output."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input while training (0 keeps the trainer's and the rollout's
    log-probs of the same weights equal)."""
    target_modules: list[str] | Literal["all-linear"] = ALL_LINEAR
    """The linear layers that get an adapter, by their last name (``q_proj``, ``down_proj``, ...),
    or ``all-linear``: every linear layer of the decoder but the output head."""
    modules_to_save: list[str] = Field(default_factory=list)
    """Modules trained in full beside the adapter and synced with it (``lm_head``, ``embed_tokens``);
    they make every sync and checkpoint larger by their size."""
    init_adapter: str | None = None
    """A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``, such as a run's
    export) to continue from; its rank and targets replace the ones above. null starts a new
    adapter (B = 0: the first policy is the base model)."""
    export_merged: bool = False
    """``trainer.export_every`` also writes ``merged/``: a Hugging Face model with the adapter
    merged into the base weights (loads without peft)."""

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list) and not value:
            raise ValueError("give at least one module name, or all-linear")
        return value


def decoder_module_names(arch: ModelArchitecture) -> tuple[str, ...]:
    """The last names of the decoder's linear layers LoRA can wrap: the attention projections and,
    on a dense model, the SwiGLU MLP's (an MoE model's experts are fused weights, not linear
    layers, and its router is no linear layer either)."""
    return ATTENTION_LINEARS + (() if arch.is_moe else DENSE_MLP_LINEARS)


def target_names(lora: LoraSpec, arch: ModelArchitecture) -> tuple[str, ...]:
    """The layer names ``lora.target_modules`` resolves to on ``arch``."""
    if lora.target_modules == ALL_LINEAR:
        return decoder_module_names(arch)
    return tuple(lora.target_modules)


def unknown_targets(lora: LoraSpec, arch: ModelArchitecture) -> Iterator[tuple[int, str]]:
    """``(index, name)`` of each target module the decoder has no linear layer of. A model with
    vision or audio encoders is checked on its decoder only when every name is a decoder name
    (the encoders' layer names are not known without building the model)."""
    if lora.target_modules == ALL_LINEAR:
        return
    known = decoder_module_names(arch)
    names = list(lora.target_modules)
    if arch.encoder_params and any(n not in known for n in names):
        return
    for i, name in enumerate(names):
        if name not in known:
            yield i, name


def adapter_params(lora: LoraSpec, arch: ModelArchitecture) -> int:
    """Parameters of the adapter (A and B of each wrapped layer, over all layers) plus the modules
    trained in full: what is trained, synced and checkpointed."""
    h, heads, kv, d = arch.hidden_size, arch.num_attention_heads, arch.num_kv_heads, arch.head_dim
    shapes = {"q_proj": (h, heads * d), "k_proj": (h, kv * d), "v_proj": (h, kv * d), "o_proj": (heads * d, h),
              "gate_proj": (h, arch.intermediate_size), "up_proj": (h, arch.intermediate_size),
              "down_proj": (arch.intermediate_size, h)}
    r = lora.rank
    per_layer = sum(r * (shapes[n][0] + shapes[n][1]) for n in target_names(lora, arch) if n in shapes)
    saved = 0
    for name in lora.modules_to_save:
        if name in ("embed_tokens", "lm_head"):
            saved += arch.vocab_size * h
        elif name == "norm":
            saved += h
        elif name in ("input_layernorm", "post_attention_layernorm"):
            saved += arch.num_layers * h
    return arch.num_layers * per_layer + saved
