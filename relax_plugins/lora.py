"""LoRA adapters on Hugging Face models, shared by the torch trainer and the rollouts (``peft``).

The trainer and the hf rollout each attach the same adapter (``attach``) to their own copy of the
base model: ``peft`` replaces each target linear layer *in place* by one that adds
``(alpha / r) * B A x``, so the Hugging Face model object keeps its type, its forward and its
key/value cache, and only the adapter's tensors are new. A weight sync then moves those tensors
alone, named as PEFT saves them (``base_model.model.<module>.lora_A.weight``: ``peft_name``), the
naming ``peft.PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` read too.

Imported inside the backends (it needs torch and peft).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from relax.contracts import LoraInfo

ADAPTER = "default"
"""The adapter's name inside peft (one adapter per model)."""
PREFIX = "base_model.model."
"""What PEFT puts before a module's name in an adapter file."""
_ADAPTER_PART = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B)\.default(?=\.|$)")
_SAVED_PART = re.compile(r"\.modules_to_save\.default(?=\.)")


def lora_config(info: LoraInfo, extra_modules_to_save: Iterable[str] = ()) -> Any:
    """The ``peft.LoraConfig`` of ``info`` (``extra_modules_to_save``: modules a role trains in full
    whatever the spec says, such as a critic's new value head)."""
    from peft import LoraConfig

    save = [*info.modules_to_save, *[m for m in extra_modules_to_save if m not in info.modules_to_save]]
    return LoraConfig(r=info.rank, lora_alpha=info.alpha, lora_dropout=info.dropout,
                      target_modules=info.target_modules, modules_to_save=save or None, bias="none")


def attach(model: Any, info: LoraInfo, trainable: bool, extra_modules_to_save: Iterable[str] = ()) -> Any:
    """Attach the adapter of ``info`` to ``model`` in place and return the ``peft.PeftModel`` around
    it: a new one (A random, B zero: the policy starts as the base model) or, with
    ``info.init_adapter``, the one saved there. Every base weight is frozen; with ``trainable`` the
    adapter's (and ``modules_to_save``'s) parameters require gradients."""
    from peft import PeftModel, get_peft_model

    if info.init_adapter is not None:
        peft_model = PeftModel.from_pretrained(model, info.init_adapter, is_trainable=trainable)
    else:
        peft_model = get_peft_model(model, lora_config(info, extra_modules_to_save))
    if not trainable:
        for param in peft_model.parameters():
            param.requires_grad_(False)
    return peft_model


def is_adapter_name(name: str) -> bool:
    """Whether a (Hugging Face model's, adapter attached) ``state_dict`` name is the adapter's: an A
    or B matrix, or a module trained in full beside it (not the frozen original it shadows)."""
    return bool(_ADAPTER_PART.search(name) or _SAVED_PART.search(name))


def peft_name(name: str) -> str:
    """An adapter tensor's name as PEFT saves it: ``model.layers.0.self_attn.q_proj.lora_A.default.weight``
    -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (and
    ``lm_head.modules_to_save.default.weight`` -> ``base_model.model.lm_head.weight``)."""
    return PREFIX + _SAVED_PART.sub("", _ADAPTER_PART.sub(r".\1", name))


def adapter_tensors(model: Any) -> dict[str, Any]:
    """The adapter's tensors of ``model`` (the Hugging Face model with the adapter attached) by
    their PEFT names, as they are (no copies)."""
    return {peft_name(name): tensor for name, tensor in model.state_dict().items() if is_adapter_name(name)}


def load_adapter(model: Any, tensors: dict[str, Any]) -> None:
    """Copy an adapter's tensors (PEFT names, as ``adapter_tensors`` gives them) into ``model``'s
    adapter in place. The names must be exactly the adapter's: a sync from another adapter shape is
    refused naming what differs, before anything is copied."""
    import torch

    own = {peft_name(name): tensor for name, tensor in model.state_dict(keep_vars=True).items()
           if is_adapter_name(name)}
    if not own:
        raise ValueError("this model has no LoRA adapter attached, so it cannot take adapter weights; the rollout "
                         "must be built with the actor's lora (RolloutContext.lora)")
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    wrong = [n for n in set(own) & set(tensors) if tuple(own[n].shape) != tuple(tensors[n].shape)]
    if missing or unexpected or wrong:
        raise ValueError(f"the adapter weights do not match this model's adapter: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}, other shapes {sorted(wrong)[:3]}; the trainer and the "
                         "rollout must attach the same lora block (rank, target_modules, modules_to_save)")
    with torch.no_grad():
        for name, tensor in tensors.items():
            own[name].copy_(tensor)


def adapter_bytes(model: Any) -> int:
    """Bytes of the adapter's tensors (what one weight sync moves)."""
    return sum(t.numel() * t.element_size() for t in adapter_tensors(model).values())
