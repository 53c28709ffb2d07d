"""Routing replay (``algorithm.router_replay``) for the ``megatron`` trainer, through megatron-core's
router replay hook (``megatron.core.transformer.moe.router_replay``).

megatron-core 0.16.1 gives every ``TopKRouter`` an optional ``router_replay`` object that its top-k
step (``moe_utils.topk_routing_with_score_function``) consults: ``get_replay_topk(scores, topk, ...,
default_compute_topk)`` returns the ``(top scores, top ids)`` of the ``[tokens, experts]`` scores
(the softmax for ``moe_router_pre_softmax``, else the logits, which Megatron then softmaxes over the
k chosen: the renormalised form). Its own ``RouterReplay`` replays *every* token of a layer from one
``[tokens, k]`` tensor and registers each instance in a process-wide list. Neither fits here:

- the bus column ``routed_experts`` (``relax_plugins.moe_routing``: ``[B, T, layers, k]``, entry t
  the routing that gave token t's distribution) holds the rollout's routing of the response
  tokens only; the prompt's positions (and padding) must be routed as the router chooses;
- one process may hold several models (an actor and its reference, the tests' pairs), so replay
  must be set per model, not through a global list.

``PartialReplay`` (a ``RouterReplay``) therefore takes a ``[tokens, k]`` target in which a row of
-1 means "route as the router chooses", computes the router's own top k in the same call, and
gathers the scores at the replayed ids, so the gate weights still come from the current router
and gradients reach it (as the ``torch`` trainer's replay does). It also records the router's own
choice (for ``r2``) and counts the replayed routings and those the router would have changed.

**Token order**: Megatron runs hidden states as ``[s, b, h]`` and its router flattens them
sequence-major, so token ``i`` of a micro-batch of ``b`` rows is column ``i // b``, row ``i % b``.
Under sequence parallelism (MoE with tp > 1) tensor-parallel rank r routes columns
``[r * s / tp, (r + 1) * s / tp)`` only. ``micro_batch_targets`` maps the bus column onto that order;
``column_from_records`` maps recorded choices back into the bus column's form.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from torch import Tensor

from relax_plugins.moe_routing import shifted_to_inputs

#: A target row of this value routes that token as the router chooses.
OWN_CHOICE = -1


class PartialReplay(RouterReplay):
    """One MoE layer's replay: megatron-core's ``RouterReplay`` protocol (``set_target_indices``,
    ``set_router_replay_action``, ``get_replay_topk``, ``clear_indices``) with per-token replay.

    Actions: ``REPLAY_FORWARD`` (and ``REPLAY_BACKWARD``, the same target: a recomputed forward
    re-runs the micro-batch whose target is set) use the target where its row is not -1; ``RECORD``
    keeps the router's own ``[tokens, k]`` choice in ``recorded_topk_idx``; no action routes plainly.
    """

    def __init__(self) -> None:
        # Not RouterReplay.__init__: it appends every instance to a process-wide list, which would
        # grow with every model built in the process; this replay is driven per model instead.
        self.target_topk_idx: Tensor | None = None
        self.recorded_topk_idx: Tensor | None = None
        self.router_replay_action: RouterReplayAction | None = None
        self.replay_backward_list: list[Tensor] = []
        self.counting = False
        """Whether replayed calls add to ``replayed`` / ``changed`` (off for recomputed forwards)."""
        self.replayed = 0
        self.changed = 0

    def set_target_indices(self, topk_indices: Tensor) -> None:
        self.target_topk_idx = topk_indices

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None,
                        default_compute_topk: Callable[..., tuple[Tensor, Tensor]] | None = None,
                        ) -> tuple[Tensor, Tensor]:
        own_scores, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        action = self.router_replay_action
        if action == RouterReplayAction.RECORD:
            self.recorded_topk_idx = own.detach()
            return own_scores, own
        if action not in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD) \
                or self.target_topk_idx is None:
            return own_scores, own
        target = self.target_topk_idx.to(own.device)
        if target.shape != own.shape:
            raise RuntimeError(f"a router routed {tuple(own.shape)} (tokens, k) but its replay target is "
                               f"{tuple(target.shape)}; the target must be built for this micro-batch's shape")
        replay = (target >= 0).all(dim=-1, keepdim=True)
        chosen = torch.where(replay, target, own)
        if self.counting:
            with torch.no_grad():
                differs = (chosen.sort(dim=-1).values != own.sort(dim=-1).values).any(dim=-1, keepdim=True)
                self.replayed += int(replay.sum())
                self.changed += int((differs & replay).sum())
        return scores.gather(1, chosen), chosen


def install(model: Any) -> list[PartialReplay]:
    """Give every ``TopKRouter`` of ``model`` (this rank's stage: its layers in order) a
    ``PartialReplay``, and return them in layer order."""
    found = []
    for module in model.modules():
        if type(module).__name__ == "TopKRouter":
            module.router_replay = PartialReplay()
            found.append(module.router_replay)
    if not found:
        raise ValueError("routing replay needs MoE layers, but the Megatron model has no TopKRouter")
    return found


def set_action(replays: list[PartialReplay], action: RouterReplayAction | None) -> None:
    for replay in replays:
        replay.router_replay_action = action


def micro_batch_targets(routed: Tensor, response_mask: Tensor, shape: tuple[int, int], layers: range,
                        sp_rank: int = 0, sp_size: int = 1) -> list[Tensor]:
    """Replay targets, one ``[tokens, k]`` int64 tensor per layer of ``layers`` (indices into the
    column's layer axis), for a micro-batch of ``routed`` (its ``[b, t, layers, k]`` bus column)
    run padded to ``shape`` (rows, columns), in the router's token order on sequence-parallel rank
    ``sp_rank`` of ``sp_size``. Rows of -1: tokens the router routes itself (prompt, padding)."""
    rows, cols = shape
    if cols % sp_size:
        raise ValueError(f"a micro-batch of {cols} columns does not split over {sp_size} sequence-parallel ranks")
    if layers.stop > routed.shape[2]:
        raise ValueError(f"the batch's routed experts cover {routed.shape[2]} MoE layers but the model has at "
                         f"least {layers.stop}; the rollout and the trainer must load the same model")
    ids, replay = shifted_to_inputs(routed, response_mask)
    ids = ids.masked_fill(~replay[..., None, None], OWN_CHOICE)
    b, t = replay.shape
    full = torch.full((rows, cols, routed.shape[2], routed.shape[3]), OWN_CHOICE, dtype=torch.long)
    full[:b, :t] = ids.cpu()
    chunk = cols // sp_size
    mine = full[:, sp_rank * chunk:(sp_rank + 1) * chunk]  # [rows, chunk, layers, k]
    ordered = mine.transpose(0, 1).reshape(chunk * rows, routed.shape[2], routed.shape[3])
    return [ordered[:, layer].contiguous() for layer in layers]


def column_from_records(records: list[Tensor], shape: tuple[int, int], trim: tuple[int, int]) -> Tensor:
    """The bus column ``[b, t, len(records), k]`` (entry t: the routing of column t - 1; column 0
    empty) of per-layer ``[cols * rows, k]`` records of a micro-batch run padded to ``shape`` in
    the router's (sequence-major, whole-sequence) order, trimmed to its real ``trim`` (b, t)."""
    rows, cols = shape
    table = torch.stack([r.reshape(cols, rows, -1).transpose(0, 1) for r in records], dim=2)
    column = torch.zeros_like(table)
    column[:, 1:] = table[:, :-1]
    return column[:trim[0], :trim[1]]
