"""FSDP2 for the ``torch`` trainer: a Hugging Face model's parameters, gradients and optimizer state
sharded over the data-parallel ranks (``torch.distributed.fsdp.fully_shard``).

Why: a replica trainer holds the whole model, its gradients and two Adam moments on every rank (a
7B model needs about 112 GiB per GPU before activations). Sharded per decoder layer, a rank holds
1/N of each and gathers one layer's full weights at a time for its forward and backward, so the
same model fits N GPUs of 1/N the memory. Everything here is what differs from a replica:

- ``shard_model``: one FSDP unit per decoder layer (the classes the model lists in
  ``_no_split_modules``: text, vision and audio blocks of VL/omni models, MoE layers alike), and the
  root for what is left (embeddings, norms, the head); mixed precision (bf16 compute, fp32 reduce)
  and CPU offload of the shards as ``FsdpOptions`` says. Gradients are *summed* over ranks (the
  divide factor is 1), as the replica trainer sums them: the policy step already weights each
  micro-batch by its share of all ranks' tokens.
- ``load_full_state``: full tensors (a forward-only role following the actor, a Hugging Face
  checkpoint) copied into the shards, each rank keeping its own slice (no communication).
- ``save_sharded`` / ``load_sharded``: the model's and the optimizer's sharded state through
  ``torch.distributed.checkpoint`` (each rank writes its own shards; a resume restores them
  exactly, on the same or on another number of ranks). A LoRA role's keep only the adapter's
  tensors and its optimizer state: the frozen base is the model's own files.
- ``export_hf``: a Hugging Face folder written by rank 0 from the ``BucketExtractor``'s buckets, one
  safetensors file per bucket, so at most one bucket of full tensors is gathered at a time.

Imports only pydantic and the standard library at the top (``FsdpOptions`` is part of the trainer's
``Config``, which ``relax validate`` reads); torch is imported inside the functions.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    import torch

#: The folder of a checkpoint that holds the sharded state (``torch.distributed.checkpoint``).
SHARDED_FOLDER = "sharded"


class FsdpOptions(BaseModel):
    """``torch`` trainer options for FSDP2 sharding (``roles.<role>.options.fsdp``)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    """Shard parameters, gradients and optimizer state over the role's data-parallel ranks (FSDP2).
    Off: every rank holds a full replica (gradients summed by one all-reduce)."""
    shard_unit: Literal["decoder_layer", "model"] = "decoder_layer"
    """What one all-gather unit holds: each decoder layer (the model's ``_no_split_modules``
    classes) and the rest at the root (peak memory one layer's full weights), or the whole model at
    once (fewer, larger collectives; peak memory the whole model's weights)."""
    mixed_precision: Literal["auto", "bf16", "off"] = "auto"
    """``bf16``: parameters gathered and computed in bfloat16, gradients reduced in float32; the
    shards, their gradients and the optimizer's state stay in the model's dtype (``model.dtype``:
    float32 for a float32 master copy). ``auto``: bf16 on GPUs, off on CPU (where bf16 matmuls are
    slow and the numerics tests compare in float32). ``off``: the model's dtype throughout."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them (the
    role's ``gradient_checkpointing`` turns it on too): activation memory of one layer instead of all."""
    cpu_offload: bool = False
    """Keep the parameter shards, their gradients and the optimizer state in host memory; each unit
    is copied to the device for its forward and backward (frees device memory for larger batches
    at the cost of host-device copies)."""
    reshard_after_forward: bool = True
    """Free a unit's gathered weights after its forward and gather them again for the backward
    (ZeRO-3); false keeps them to the backward (ZeRO-2: more memory, one all-gather fewer)."""


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's blocks to shard one by one: modules whose class the model lists in
    ``_no_split_modules`` (Hugging Face's name for its decoder, vision and audio blocks), outermost
    first and never one inside another."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    found: list[torch.nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or module is model:
            continue
        if type(module).__name__ in names:
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found


def mixed_precision_policy(options: FsdpOptions, device: torch.device) -> Any:
    """The ``MixedPrecisionPolicy`` the options ask for on ``device`` (None: the model's dtype)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    wanted = options.mixed_precision == "bf16" or (options.mixed_precision == "auto" and device.type == "cuda")
    if not wanted:
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard_model(model: torch.nn.Module, options: FsdpOptions, device: torch.device, checkpointing: bool) -> None:
    """Shard ``model`` (built in full on this rank) in place over the default process group's ranks,
    as ``options`` says, and leave its shards on ``device`` (or in host memory with ``cpu_offload``).
    ``checkpointing``: recompute each layer's activations in the backward."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

    if checkpointing or options.activation_checkpointing:
        # Non-reentrant checkpointing recomputes inside the FSDP unit's own gather.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": options.reshard_after_forward}
    policy = mixed_precision_policy(options, device)
    if policy is not None:
        kwargs["mp_policy"] = policy
    if options.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    # fully_shard moves each unit's parameters to the mesh's device as it shards it (host memory with
    # cpu_offload), so a model built on the host never lands on one device whole.
    if options.shard_unit == "decoder_layer":
        layers = decoder_layers(model)
        if not layers:
            raise ValueError(f"{type(model).__name__} lists no decoder layer classes (_no_split_modules), so "
                             "it cannot be sharded per layer; set fsdp.shard_unit: model")
        for layer in layers:
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Sum, do not average, over ranks: each micro-batch's loss is already weighted by its
            # share of all ranks' tokens, as the replica trainer's summed gradients expect.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` is an FSDP2 module (its parameters are ``DTensor`` shards)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def named_targets(model: torch.nn.Module) -> dict[str, Any]:
    """The model's parameters and buffers by their ``state_dict`` names (tied names included)."""
    return model.state_dict(keep_vars=True)


def load_full_state(model: torch.nn.Module, weights: dict[str, Any]) -> None:
    """Copy full tensors (a Hugging Face ``state_dict``) into a sharded model in place: each rank keeps
    its own slice of each (``distribute_tensor`` without a source rank: no communication). Checked as
    ``relax_plugins.hf_weights.load_state`` checks a replica's (a tied key may be missing)."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    from relax_plugins.hf_weights import shape_mismatch

    targets = named_targets(model)
    expected = {key: list(t.shape) for key, t in targets.items()}
    for group in _tied_groups(targets):
        if any(key in weights for key in group):
            for key in group:
                if key not in weights:
                    expected.pop(key)
    problem = shape_mismatch({k: list(v.shape) for k, v in weights.items()}, expected)
    if problem:
        raise ValueError(problem)
    with torch.no_grad():
        for key, value in weights.items():
            target = targets[key]
            if isinstance(target, DTensor):
                local = distribute_tensor(value.to(target.dtype), target.device_mesh, target.placements,
                                          src_data_rank=None)
                target.to_local().copy_(local.to_local())
            else:
                target.copy_(value)


def _tied_groups(targets: dict[str, Any]) -> list[list[str]]:
    """Names that are one parameter (a tied ``lm_head.weight`` and the input embedding)."""
    groups: dict[int, list[str]] = {}
    for key, value in targets.items():
        groups.setdefault(id(value), []).append(key)
    return [keys for keys in groups.values() if len(keys) > 1]


def untied_names(model: torch.nn.Module) -> set[str]:
    """The ``state_dict`` names a Hugging Face folder stores: one name per tied group (the first,
    the input embedding), as ``save_pretrained`` does."""
    targets = named_targets(model)
    dropped = {key for group in _tied_groups(targets) for key in group[1:]}
    return set(targets) - dropped


def save_sharded(model: torch.nn.Module, optimizer: Any, folder: Path,
                 only: Callable[[str], bool] | None = None) -> None:
    """Write the model's and the optimizer's sharded state into ``folder`` (every rank its own
    shards; a collective). ``only`` keeps the model tensors whose names it accepts (a LoRA adapter's:
    the frozen base never changes, so its shards are not written again)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer if optimizer is not None else [])
    if only is not None:
        model_state = {name: value for name, value in model_state.items() if only(name)}
    state = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optim_state
    dcp.save(state, checkpoint_id=str(folder))


def load_sharded(model: torch.nn.Module, optimizer: Any, folder: Path,
                 only: Callable[[str], bool] | None = None) -> None:
    """Restore what ``save_sharded`` wrote (a collective); the optimizer's state when both have it.
    ``only``: the model tensors it holds, as given to ``save_sharded`` (the others stay as they are)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer if optimizer is not None else [])
    if only is not None:
        model_state = {name: value for name, value in model_state.items() if only(name)}
    state = {"model": model_state}
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    has_optimizer = any(key.startswith("optimizer.") for key in metadata.state_dict_metadata)
    if optimizer is not None and has_optimizer:
        state["optimizer"] = optim_state
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer if "optimizer" in state else [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optimizer", {}), options=StateDictOptions(strict=only is None))


def export_hf(buckets: Iterator[list[tuple[str, torch.Tensor]]], keep: set[str], folder: Path | None) -> None:
    """Write a Hugging Face weights folder from full-tensor buckets: one ``model-NNNNN.safetensors``
    per bucket and the ``model.safetensors.index.json`` that maps each name to its file, only names
    in ``keep``. Every rank iterates the buckets (their gathers are collectives); the rank given a
    ``folder`` writes, the others pass None."""
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    files: list[tuple[str, dict[str, torch.Tensor]]] = []
    total = 0
    for bucket in buckets:
        if folder is None:
            continue
        tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in bucket if name in keep}
        if not tensors:
            continue
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        files.append((name, {}))
        for key, tensor in tensors.items():
            weight_map[key] = name
            total += tensor.numel() * tensor.element_size()
    if folder is None:
        return
    count = len(files)
    renamed = {}
    for i, (name, _) in enumerate(files, start=1):  # the Hugging Face shard names: -of-NNNNN
        final = f"model-{i:05d}-of-{count:05d}.safetensors"
        (folder / name).rename(folder / final)
        renamed[name] = final
    index = {"metadata": {"total_size": total}, "weight_map": {k: renamed[v] for k, v in sorted(weight_map.items())}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


__all__ = ["SHARDED_FOLDER", "FsdpOptions", "decoder_layers", "export_hf", "is_sharded", "load_full_state",
           "load_sharded", "mixed_precision_policy", "save_sharded", "shard_model", "untied_names"]
