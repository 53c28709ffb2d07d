"""How a step's samples are laid out on the bus.

Token data travels as dense tensors in the trainer's own layout (``relax.algo.batch``): per row
``[left pad][prompt][response][right pad]`` in ``input_ids`` and ``rollout_logprobs``, plus
``lengths`` (prompt and response length). One dense tensor per column costs the bus a third of
what a list of per-row tensors costs (measured: 19 ms against 58 ms to put 128 rows here), and the
actor rebuilds its ``TrainBatch`` without re-padding (``TrainBatch.from_bus``). The text columns
are what rewards read. The column names and groups are ``relax.roles``'s.

A batch's forms, from the rollout to the optimizer: the rollout backend's ``Generation`` list ->
bus columns (``rollout_columns``, a ``dict`` of ``Column`` -> tensor or list) -> ``relax.bus.BusBatch``
(what a role takes from the bus) -> ``relax.algo.batch.TrainBatch`` (``TrainBatch.from_bus``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from relax.algo.batch import TrainBatch, pack_response_values, pack_tokens
from relax.contracts import Generation
from relax.roles import Column


def media_columns(spec: Any) -> tuple[Column, ...]:
    """The media column, for a run whose data has media (``data.media_keys``); else nothing: per
    row, a multimodal sample's context (prompt text and media references) as a JSON string (the
    media travel by reference, never decoded: see ``relax.media``)."""
    return (Column.media,) if spec.data.media_keys else ()


def rollout_columns(gens: Sequence[Generation], prompts: Sequence[str], labels: Sequence[Any],
                    pad_token_id: int, media: Sequence[str] | None = None, ragged: bool = False) -> dict[Column, Any]:
    """The bus columns of a step's generations (``prompts``/``labels``/``media`` indexed by
    prompt_index; ``media`` holds each prompt's JSON context when the data has media).

    ``ragged``: the step is put in several units (several rollout replicas), whose dense layouts
    would differ; the token columns then go as one unpadded ``prompt + response`` tensor per row,
    and readers lay them out again (``relayout``)."""
    lengths = torch.tensor([[len(g.prompt_ids), len(g.response_ids)] for g in gens], dtype=torch.long)
    if ragged:
        input_ids: Any = [torch.tensor([*g.prompt_ids, *g.response_ids], dtype=torch.long) for g in gens]
        logprobs: Any = [torch.tensor([0.0] * len(g.prompt_ids) + list(g.logprobs), dtype=torch.float32)
                         for g in gens]
    else:
        input_ids, logprobs = pack_tokens(gens, pad_token_id)
    columns = {
        Column.prompt: [prompts[g.prompt_index] for g in gens],
        Column.response: [g.text for g in gens],
        Column.label: [labels[g.prompt_index] for g in gens],
        Column.input_ids: input_ids,
        Column.rollout_logprobs: logprobs,
        Column.lengths: lengths,
    }
    if media is not None:
        columns[Column.media] = [str(media[g.prompt_index]) for g in gens]
    if any(g.loss_mask is not None or g.token_versions is not None for g in gens):  # trajectories, partial rollouts
        columns.update(agent_columns(gens, ragged, input_ids))
    if any(g.routed_experts is not None for g in gens):  # MoE routing replay (r3)
        columns[Column.routed_experts] = routing_column(gens, ragged, input_ids)
    return columns


def routed_dtype(max_id: int) -> torch.dtype:
    """The smallest integer dtype that holds expert ids up to ``max_id`` (uint8 up to 256 experts)."""
    if max_id < 256:
        return torch.uint8
    if max_id < 2 ** 15:
        return torch.int16
    return torch.int32


def routing_column(gens: Sequence[Generation], ragged: bool, input_ids: Any) -> Any:
    """The rollout's recorded expert ids (``Generation.routed_experts``) in the layout of
    ``input_ids`` with two more dimensions, ``[B, T, layers, k]`` (or one ``[P + R, layers, k]``
    tensor per row when ragged), 0 off the response, in the smallest integer dtype that holds
    them (uint8 up to 256 experts: 4 bytes a token for a 2-layer top-2 model)."""
    shape = next((len(g.routed_experts[0]), len(g.routed_experts[0][0])) for g in gens if g.routed_experts)
    tables = []
    for i, g in enumerate(gens):
        routed = g.routed_experts
        if routed is None or len(routed) != len(g.response_ids):
            raise ValueError(f"generation {i} has {len(g.response_ids)} response tokens but routed experts for "
                             f"{'none' if routed is None else len(routed)}; a rollout that records routing gives "
                             "one [layers][k] entry per response token of every generation")
        table = torch.tensor(routed, dtype=torch.long).reshape(len(routed), *shape)
        tables.append(table)
    dtype = routed_dtype(max((int(t.max()) for t in tables if t.numel()), default=0))
    if ragged:
        return [torch.cat([torch.zeros((len(g.prompt_ids), *shape), dtype=dtype), t.to(dtype)])
                for g, t in zip(gens, tables)]
    rows, width = input_ids.shape
    prompt_width = max(len(g.prompt_ids) for g in gens)
    out = torch.zeros((rows, width, *shape), dtype=dtype)
    for i, table in enumerate(tables):
        out[i, prompt_width:prompt_width + len(table)] = table.to(dtype)
    return out


def agent_columns(gens: Sequence[Generation], ragged: bool, input_ids: Any) -> dict[Column, Any]:
    """The agentic token columns, in the layout of ``input_ids``: the loss mask (1 on the tokens
    the policy chose) and each token's policy version."""
    masks = [g.loss_mask if g.loss_mask is not None else [1] * len(g.response_ids) for g in gens]
    versions = [g.token_versions if g.token_versions is not None else [0] * len(g.response_ids) for g in gens]
    if ragged:
        return {Column.loss_mask: [torch.tensor([0] * len(g.prompt_ids) + list(m), dtype=torch.int8)
                                   for g, m in zip(gens, masks)],
                Column.token_versions: [torch.tensor([0] * len(g.prompt_ids) + list(v), dtype=torch.int32)
                                        for g, v in zip(gens, versions)]}
    width = input_ids.shape[1]
    return {Column.loss_mask: pack_response_values(gens, masks, width, torch.int8),
            Column.token_versions: pack_response_values(gens, versions, width, torch.int32)}


#: Token columns the rollout writes ragged when a step comes in several units.
RAGGED_COLUMNS = (Column.input_ids, Column.rollout_logprobs, Column.loss_mask, Column.token_versions,
                  Column.routed_experts)


def restack(batch: Any, keep_ragged: bool) -> Any:
    """A ``BusBatch`` read together with orphan rows of another width comes back with its dense
    columns as lists of rows; once the orphans are dropped the rows agree again: stack them.
    ``keep_ragged`` leaves the rollout's ragged token columns to ``relayout``."""
    for name, value in batch.fields.items():
        if keep_ragged and name in RAGGED_COLUMNS:
            continue
        if isinstance(value, list) and value and all(isinstance(v, torch.Tensor) for v in value) \
                and len({v.shape for v in value}) == 1:
            batch.fields[name] = torch.stack(value)
    return batch


def relayout(batch: Any) -> Any:
    """A ``BusBatch`` whose ragged token columns (``rollout_columns(ragged=True)``) are laid out as
    one dense tensor in the trainer's layout, the prompts right-aligned at the batch's widest
    prompt. Columns other roles wrote for the whole step are dense already and stay as they are."""
    lengths = batch.fields.get(Column.lengths)
    ragged = [name for name in RAGGED_COLUMNS if isinstance(batch.fields.get(name), list)]
    if lengths is None or not ragged:
        return batch
    lengths = lengths.long()
    prompt_width = int(lengths[:, 0].max())
    width = prompt_width + int(lengths[:, 1].max())
    for name in ragged:
        rows = batch.fields[name]
        dtype = rows[0].dtype
        for row in rows[1:]:  # units may have chosen different dtypes (routed experts)
            dtype = torch.promote_types(dtype, row.dtype)
        dense = torch.zeros((len(rows), width, *rows[0].shape[1:]), dtype=dtype)
        for i, row in enumerate(rows):
            start = prompt_width - int(lengths[i, 0])
            dense[i, start:start + row.shape[0]] = row
        batch.fields[name] = dense
    return batch


def token_column(batch: TrainBatch, values: torch.Tensor) -> torch.Tensor:
    """A ``[B, T]`` token tensor a role computed, in the bus layout (0 off the response tokens)."""
    return (values.float() * batch.response_mask).contiguous()
