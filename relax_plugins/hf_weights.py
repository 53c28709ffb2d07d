"""Moving whole Hugging Face ``state_dict``s in and out of a model (used by the hf and torch backends).

Imported inside the backends' methods (it needs torch).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch


def shared_groups(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> list[list[str]]:
    """Groups of state-dict keys that share one storage (a tied ``lm_head.weight`` and the input
    embedding), each of two or more keys (``state``: the model's ``state_dict(keep_vars=True)``,
    when the caller has it)."""
    groups: dict[tuple[int, tuple[int, ...]], list[str]] = defaultdict(list)
    for key, tensor in (state if state is not None else model.state_dict(keep_vars=True)).items():
        groups[(tensor.data_ptr(), tuple(tensor.shape))].append(key)
    return [keys for keys in groups.values() if len(keys) > 1]


def load_state(model: torch.nn.Module, weights: dict[str, Any]) -> None:
    """Copy ``weights`` into ``model`` in place, checking that every tensor is accounted for.

    A key may be missing only if another key sharing its storage is given (tied embeddings saved
    once). Unexpected keys, missing untied keys and wrong shapes are errors naming a few of them,
    raised before anything is copied. The tensors are copied straight into the model's parameters
    and buffers: ``load_state_dict``'s walk over every module cost the tiny CPU preset's rollout
    0.34 ms a step against 0.15 ms."""
    state = model.state_dict(keep_vars=True)
    missing = set(state) - set(weights)
    for group in shared_groups(model, state):
        if any(key not in missing for key in group):
            missing -= set(group)
    unexpected = sorted(set(weights) - set(state))
    misshaped = sorted(k for k in set(weights) & set(state) if tuple(weights[k].shape) != tuple(state[k].shape))
    if missing or unexpected or misshaped:
        raise ValueError(
            f"weights do not match the model: missing {sorted(missing)[:5]}, unexpected {unexpected[:5]}, "
            f"wrong shape {misshaped[:5]}; push a full state_dict of the same architecture"
        )
    with torch.no_grad():
        for key, value in weights.items():
            state[key].copy_(value)


def state_copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full ``state_dict`` (tied keys included, e.g. ``lm_head.weight``) as detached clones,
    so later optimizer steps do not change what was handed out."""
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def shape_mismatch(got: dict[str, list[int]], expected: dict[str, list[int]]) -> str:
    """What differs between the names and shapes of some weights and a model's (empty when nothing
    does): the message every weight push refuses with, before it loads anything."""
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    misshaped = sorted(k for k in set(got) & set(expected) if list(got[k]) != list(expected[k]))
    if not (missing or unexpected or misshaped):
        return ""
    return (f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}, wrong shape "
            f"{misshaped[:5]}; push a full state_dict of the same architecture")


def load_stream(model: torch.nn.Module, shapes: dict[str, list[int]], tensors: Any) -> int:
    """Copy ``(name, tensor)`` pairs into ``model`` in place as they arrive (a weight group's round,
    one bucket at a time). ``shapes`` are the round's names and shapes, announced before its data:
    checked first as ``load_state`` checks a state_dict, so a round that does not fit is consumed
    (the sender's round completes) and refused before any of it is loaded. Returns the count."""
    targets = model.state_dict(keep_vars=True)
    expected = {key: list(tensor.shape) for key, tensor in targets.items()}
    for group in shared_groups(model):  # a tied key may be absent when another of its group is sent
        if any(key in shapes for key in group):
            for key in group:
                if key not in shapes:
                    expected.pop(key)
    problem = shape_mismatch(shapes, expected)
    if problem:
        for _ in tensors:  # drain: the sender's round completes
            pass
        raise ValueError(problem)
    count = 0
    with torch.no_grad():
        for name, tensor in tensors:
            targets[name].copy_(tensor)
            count += 1
    return count
