"""The torch trainer's LoRA adapter (``roles.<role>.lora``): what it trains, what leaves, what it saves.

``TrainedAdapter`` attaches the adapter to the trainer's Hugging Face model in place
(``relax_plugins.lora.attach``): the model object, its forward and its packing stay as they are, the
base weights are frozen, so the optimizer is built over the adapter's parameters alone (their
gradients and AdamW moments are the only training state besides the frozen base).

- Weight syncs: the trainer's extractor keeps only the adapter's tensors (``names``) under their
  PEFT names (``rename``), which the hf rollout loads into its own adapter and vLLM as a LoRA.
- The reference policy is the base model with the adapter disabled (``disabled``, the trainer's
  ``compute_base_logprobs``): no second copy of the model. On a 7B model in bf16 that is 15 GB not
  held (docs/lora.md).
- Checkpoints hold the adapter (``adapter_model.safetensors`` + ``adapter_config.json``, PEFT's own
  folder) and its optimizer state; an export is that adapter folder, which
  ``peft.PeftModel.from_pretrained`` loads on the base, plus ``merged/`` when ``export_merged``.

Imported inside the backend (it needs torch and peft).
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from relax.contracts import LoraInfo
from relax_plugins.lora import adapter_bytes, attach, is_adapter_name, load_adapter, peft_name

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
MERGED = "merged"
"""The folder of an export's merged model (``LoraInfo.export_merged``)."""

_PIECE = re.compile(r"^(?P<module>.+)\.(?:(?P<lora>lora_A|lora_B|lora_embedding_A|lora_embedding_B)\.default"
                    r"(?:\.weight)?|base_layer\.(?P<base>weight))$")
"""A tensor a merge combines: an adapted module's base weight, or its A or B matrix."""


def merged_name(name: str) -> str | None:
    """A ``state_dict`` name of the model with the adapter attached, in the merged model (the plain
    Hugging Face names): ``q_proj.base_layer.weight`` -> ``q_proj.weight``, a module trained in full
    (``modules_to_save``) under its own name; None for what a merged model does not hold (the A and
    B matrices, the frozen original a trained module shadows)."""
    if is_adapter_name(name) and not re.search(r"\.modules_to_save\.default\.", name):
        return None
    if ".original_module." in name:
        return None
    return re.sub(r"\.modules_to_save\.default\.", ".", name).replace(".base_layer.", ".")


class TrainedAdapter:
    """A LoRA adapter attached to a trainer's model (``model`` stays the Hugging Face model)."""

    def __init__(self, model: Any, info: LoraInfo, trainable: bool, extra_modules_to_save: tuple[str, ...] = (),
                 gradient_checkpointing: bool = False) -> None:
        self.info = info
        self.peft = attach(model, info, trainable, extra_modules_to_save)
        self.model = self.peft.get_base_model()
        """The Hugging Face model, adapter attached: what the trainer runs forward passes on."""
        if trainable and gradient_checkpointing:
            # The frozen embeddings' output has no grad: checkpointed layers would see no input that
            # needs one and drop the adapters' gradients.
            self.model.enable_input_require_grads()

    # -- what leaves: the extractor's filter and names ------------------------------------------

    @staticmethod
    def names(name: str) -> bool:
        """Whether a ``state_dict`` name of the model is the adapter's (the extractor's ``include``)."""
        return is_adapter_name(name)

    @staticmethod
    def rename(name: str) -> str:
        """An adapter tensor's name in the rollouts' naming: PEFT's (the extractor's ``rename``)."""
        return peft_name(name)

    def sync_bytes(self) -> int:
        """Bytes one weight sync moves: the adapter's tensors."""
        return adapter_bytes(self.model)

    def load(self, tensors: dict[str, Any]) -> None:
        """Take an adapter's tensors (PEFT names): how actor_fwd follows the actor."""
        load_adapter(self.model, tensors)

    # -- the base policy ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model, for as long as the block runs: the adapter's layers add nothing."""
        with self.peft.disable_adapter():
            yield

    # -- save and load -----------------------------------------------------------------------------

    def save(self, folder: Path) -> None:
        """Write the adapter as PEFT's folder (``adapter_config.json`` + ``adapter_model.safetensors``)."""
        self.peft.save_pretrained(str(folder), safe_serialization=True)

    def save_gathered(self, tensors: dict[str, Any], folder: Path) -> None:
        """Write PEFT's folder from the adapter's full tensors (PEFT names), gathered from a sharded
        model's shards (``peft``'s own save would read the shards)."""
        from safetensors.torch import save_file

        self.peft.peft_config["default"].save_pretrained(str(folder))
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(folder / ADAPTER_FILE),
                  metadata={"format": "pt"})

    def restore(self, folder: Path) -> None:
        """Load the adapter a ``save`` wrote into this one, exactly (the names and shapes must match)."""
        from safetensors.torch import load_file

        path = folder / ADAPTER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{folder} holds no {ADAPTER_FILE}; a LoRA role resumes from a checkpoint its "
                                    "own save() wrote (it holds the adapter only)")
        self.load(load_file(str(path), device="cpu"))

    def merged(self, buckets: Iterable[list[tuple[str, Any]]]) -> Iterator[list[tuple[str, Any]]]:
        """The model's full tensors (``(name, tensor)`` buckets, the adapter attached) as the merged
        model's: each adapted weight ``W + scaling * B A`` (as peft's ``merge_and_unload`` computes it,
        in float32) once its base weight, A and B have all arrived, renamed by ``merged_name``. Holds
        only the pieces of layers not yet complete, so a sharded model merges bucket by bucket."""
        from peft.tuners.lora import LoraLayer

        layers = {name: module for name, module in self.model.named_modules() if isinstance(module, LoraLayer)}
        pending: dict[str, dict[str, Any]] = {}
        for bucket in buckets:
            out = []
            for name, tensor in bucket:
                piece = _PIECE.match(name)
                if piece is None or piece["module"] not in layers:
                    target = merged_name(name)
                    if target is not None:
                        out.append((target, tensor))
                    continue
                module = piece["module"]
                parts = pending.setdefault(module, {})
                parts[piece["lora"] or "W"] = tensor
                if "W" in parts and len(parts) == 3:
                    del pending[module]
                    out.append((f"{module}.weight", _merge(parts, layers[module])))
            yield out
        if pending:
            raise RuntimeError(f"the model's tensors ended before the adapter of {sorted(pending)[:3]} was complete "
                               "(a base weight, lora_A and lora_B each); the merged model would be wrong")

    def save_merged(self, folder: Path) -> None:
        """Write the model with the adapter merged into its weights (a plain Hugging Face folder that
        loads without peft), from a copy: the trainer keeps its adapter."""
        merged = copy.deepcopy(self.peft).merge_and_unload()
        merged.save_pretrained(str(folder), safe_serialization=True)


def _merge(parts: dict[str, Any], layer: Any) -> Any:
    """``W + scaling * B A`` of one adapted layer in float32, in ``W``'s dtype (an embedding's and a
    ``fan_in_fan_out`` layer's product transposed, as peft's ``get_delta_weight``)."""
    if "lora_A" in parts:
        delta = parts["lora_B"].float() @ parts["lora_A"].float()
        if getattr(layer, "fan_in_fan_out", False):
            delta = delta.T
    else:
        delta = (parts["lora_embedding_B"].float() @ parts["lora_embedding_A"].float()).T
    weight = parts["W"]
    return (weight.float() + delta * layer.scaling["default"]).to(weight.dtype)
