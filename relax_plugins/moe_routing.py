"""Mixture-of-experts routing of Hugging Face models: recording the experts each router chose, and
making a forward pass use recorded choices (routing replay, ``algorithm.router_replay``).

Why: an MoE's router picks each token's top-k experts from scores that can be nearly tied, so the
trainer's forward pass (another batch shape, other kernels, weights a few updates newer) may pick
other experts than the rollout did for the same token, and its log-probs then describe a policy
that did not generate the sample. Replaying the rollout's choices (R3) removes that source of
mismatch; replaying the trainer's own choices from its log-prob pass in later updates of the step
(R2) removes the drift between mini-batches.

**Format** (the ``hf`` rollout's ``Generation.routed_experts``, the bus column ``routed_experts``):
per response token ``j``, per MoE layer (in model order), the ``k`` expert ids the router chose
in the forward pass whose output gave token ``j``'s distribution: the prompt's last token for
``j = 0`` and response token ``j - 1`` after. Aligned like the log-probs, so a token-column layout
holds it at token ``j``'s own column and every id that shaped the sampled distributions is kept
(the last response token is never fed to the model). An engine that captures per position
routing (vLLM's routed-experts capture, ``[positions, layers, k]``) maps onto it by taking
positions ``P - 1 .. P + R - 2`` of a row of ``P`` prompt and ``R`` response tokens.

**Routers**: the top-k routers of transformers' Qwen2-MoE / Qwen3-MoE families (``*TopKRouter``:
softmax over the expert logits, top k, optionally renormalised; ``forward`` returns
``(logits, scores, indices)``). A replayed router still computes its logits, so its gate weights
(softmax at the replayed ids, renormalised when the router renormalises) carry gradients to it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

#: Router classes whose forward is ``(logits, scores, indices)`` with scores the softmax's top k
#: (renormalised when ``norm_topk_prob``): the form replay reproduces.
ROUTER_CLASSES = frozenset({"Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter"})


def routers(model: Any) -> list[Any]:
    """The top-k routers of the model's MoE layers, in layer order (empty for a dense model).

    A model whose config declares experts but whose routers are of another form is refused: its
    routing could be neither recorded nor replayed faithfully."""
    found = [m for m in model.modules() if type(m).__name__ in ROUTER_CLASSES]
    config = getattr(model, "config", None)
    declared = int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0)
    if declared and not found:
        raise ValueError(f"{type(model).__name__} has {declared} experts per layer but no router of a form routing "
                         f"replay knows ({', '.join(sorted(ROUTER_CLASSES))}); use a Qwen2/Qwen3-MoE model, "
                         "or set algorithm.router_replay: off")
    return found


class GenerationRouting:
    """Records, while a model ``generate``s ``rows`` sequences with a KV cache, the experts of each
    forward call's last position per row and router: the prefill's gives the first new token's
    routing, each decode step's the next one's (see the module docstring's format).

    Use as a context manager around ``generate``; then ``per_row(lengths)``."""

    def __init__(self, model: Any, rows: int) -> None:
        self.routers = routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no MoE router to record; routing replay needs a "
                             "mixture-of-experts model (set algorithm.router_replay: off for a dense one)")
        self.rows = rows
        self.calls: list[list[Tensor]] = [[] for _ in self.routers]
        self._handles: list[Any] = []

    def __enter__(self) -> GenerationRouting:
        for layer, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int) -> Any:
        def record(module: Any, inputs: Any, output: Any) -> None:
            indices = output[2]
            self.calls[layer].append(indices.reshape(self.rows, -1, indices.shape[-1])[:, -1].detach().cpu())
        return record

    def per_row(self, lengths: list[int]) -> list[list[list[list[int]]]]:
        """Per row, per new token (the first ``lengths[i]`` of row i), per layer, the k expert ids."""
        steps = {len(c) for c in self.calls}
        if len(steps) != 1 or (lengths and max(lengths) > next(iter(steps))):
            raise RuntimeError(f"routing was recorded for {sorted(steps)} forward calls per layer but up to "
                               f"{max(lengths, default=0)} tokens were generated; generate must run one forward "
                               "call per new token (KV cache on, no speculative or assisted decoding)")
        if not next(iter(steps)):
            return [[] for _ in lengths]
        table = torch.stack([torch.stack(c, dim=1) for c in self.calls], dim=2)  # [rows, steps, layers, k]
        return [table[i, :n].tolist() for i, n in enumerate(lengths)]


def shifted_to_inputs(routed: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """The recorded experts of a ``[B, T, layers, k]`` token column (entry t: the routing that gave
    token t's distribution) moved onto the positions whose forward made it (column t - 1), and
    where to replay them: ``(ids [B, T, layers, k] int64, replay [B, T] bool)``."""
    ids = torch.zeros(routed.shape, dtype=torch.long, device=routed.device)
    ids[:, :-1] = routed[:, 1:].long()
    replay = torch.zeros(response_mask.shape, dtype=torch.bool, device=response_mask.device)
    replay[:, :-1] = response_mask[:, 1:] > 0
    return ids, replay


@contextmanager
def replayed_routing(model: Any, routed: Tensor, response_mask: Tensor,
                     stats: dict[str, float] | None = None) -> Iterator[None]:
    """Within the block, the model's forward passes over a ``[B, T]`` batch route each response
    token's predecessor with the experts of ``routed`` (the batch's ``[B, T, layers, k]`` token
    column), and every other position as the router chooses. Gate weights come from the current
    router's probabilities at the replayed ids (renormalised over them when the router
    renormalises its top k), so gradients still reach the router. The routers' forwards are
    patched for the duration of the block only.

    ``stats`` (optional) accumulates ``replayed`` (replayed token-layer routings) and ``changed``
    (those whose expert set differs from the one the router chose itself)."""
    found = routers(model)
    if routed.shape[2] != len(found):
        raise ValueError(f"the batch's routed experts cover {routed.shape[2]} MoE layers but the model has "
                         f"{len(found)}; the rollout and the trainer must load the same model")
    ids, replay = shifted_to_inputs(routed, response_mask)
    rows, width = replay.shape
    flat_ids = ids.reshape(rows * width, len(found), -1)
    flat_replay = replay.reshape(rows * width, 1)
    patched = []
    try:
        for layer, router in enumerate(found):
            if flat_ids.shape[-1] != router.top_k:
                raise ValueError(f"the batch's routed experts hold {flat_ids.shape[-1]} experts per token but "
                                 f"the model's routers pick {router.top_k}; record and replay the same model")
            patched.append(router)
            router.forward = _replaying_forward(router, router.forward, flat_ids[:, layer], flat_replay, stats)
        yield
    finally:
        for router in patched:
            del router.forward  # back to the class's forward


def _replaying_forward(router: Any, original: Any, recorded: Tensor, replay: Tensor,
                       stats: dict[str, float] | None) -> Any:
    def forward(hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logits, scores, indices = original(hidden_states)
        if indices.shape[0] != recorded.shape[0]:
            raise RuntimeError(f"a router saw {indices.shape[0]} positions but the replayed batch has "
                               f"{recorded.shape[0]}; replay wraps one forward pass over the whole batch")
        replay_here = replay.to(indices.device)
        chosen = torch.where(replay_here, recorded.to(indices.device), indices)
        if stats is not None:
            with torch.no_grad():
                differs = (chosen.sort(dim=-1).values != indices.sort(dim=-1).values).any(dim=-1, keepdim=True)
                stats["replayed"] = stats.get("replayed", 0.0) + float(replay_here.sum())
                stats["changed"] = stats.get("changed", 0.0) + float((differs & replay_here).sum())
        weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, chosen)
        if getattr(router, "norm_topk_prob", False):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(scores.dtype), chosen
    return forward


@contextmanager
def recorded_routing(model: Any, rows: int, width: int) -> Iterator[list[Tensor]]:
    """Within the block, one forward pass over a ``[rows, width]`` batch records every router's
    choices. The yielded list receives, once the block ends, the ``[rows, width, layers, k]``
    token column of them in the bus form (entry t: the routing of column t - 1; column 0 empty),
    ready for ``replayed_routing`` (the trainer's own routing, ``router_replay: r2``)."""
    found = routers(model)
    calls: list[list[Tensor]] = [[] for _ in found]

    def hook(layer: int) -> Any:
        def record(module: Any, inputs: Any, output: Any) -> None:
            calls[layer].append(output[2].detach())
        return record

    handles = [router.register_forward_hook(hook(layer)) for layer, router in enumerate(found)]
    out: list[Tensor] = []
    try:
        yield out
    finally:
        for handle in handles:
            handle.remove()
    if any(len(c) != 1 for c in calls):
        raise RuntimeError("recorded_routing wraps exactly one forward pass; its routers ran "
                           f"{[len(c) for c in calls]} times")
    table = torch.stack([c[0].reshape(rows, width, -1) for c in calls], dim=2)
    column = torch.zeros_like(table)
    column[:, 1:] = table[:, :-1]
    out.append(column)
