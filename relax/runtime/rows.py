"""How a step's samples are laid out on the bus.

Token data travels as dense tensors in the trainer's own layout (``relax.algo.batch``): per row
``[left pad][prompt][response][right pad]`` in ``input_ids`` and ``rollout_logprobs``, plus
``lengths`` (prompt and response length). One dense tensor per column costs the bus a third of
what a list of per-row tensors costs (measured: 19 ms against 58 ms to put 128 rows here), and the
actor rebuilds its ``TrainBatch`` without re-padding. The text columns are what rewards read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from relax.algo.batch import TrainBatch, collate
from relax.contracts import Generation

#: Columns the rollout writes for every sample.
ROLLOUT_COLUMNS = ("prompt", "response", "label", "input_ids", "rollout_logprobs", "lengths")
#: Columns the actor always reads.
TRAIN_COLUMNS = ("input_ids", "rollout_logprobs", "lengths", "advantages")
#: Columns a role needs to rebuild a sample's tokens (reference, critic and actor_fwd read these).
TOKEN_COLUMNS = ("input_ids", "lengths")
#: Token columns written by other roles, attached to a ``TrainBatch`` when read.
OPTIONAL_TOKEN_COLUMNS = ("ref_logprobs", "old_logprobs", "values", "returns")
#: Per row, a multimodal sample's context (prompt text and media references) as a JSON string: the
#: media travel by reference, never decoded (see ``relax.media``). Written only when the data has media.
MEDIA_COLUMN = "media"


def media_columns(spec: Any) -> tuple[str, ...]:
    """The media column, for a run whose data has media (``data.media_keys``); else nothing."""
    return (MEDIA_COLUMN,) if spec.data.media_keys else ()


def token_columns(spec: Any) -> tuple[str, ...]:
    """What a model role reads to rebuild a sample's model inputs: the tokens, and the media
    references of a multimodal run."""
    return (*TOKEN_COLUMNS, *media_columns(spec))


def rollout_columns(gens: Sequence[Generation], prompts: Sequence[str], labels: Sequence[Any],
                    pad_token_id: int, media: Sequence[str] | None = None, ragged: bool = False) -> dict[str, Any]:
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
        packed = collate(gens, torch.zeros(len(gens)), pad_token_id)
        input_ids, logprobs = packed.input_ids, packed.rollout_logprobs
    columns = {
        "prompt": [prompts[g.prompt_index] for g in gens],
        "response": [g.text for g in gens],
        "label": [labels[g.prompt_index] for g in gens],
        "input_ids": input_ids,
        "rollout_logprobs": logprobs,
        "lengths": lengths,
    }
    if media is not None:
        columns[MEDIA_COLUMN] = [str(media[g.prompt_index]) for g in gens]
    return columns


#: Token columns the rollout writes ragged when a step comes in several units.
RAGGED_COLUMNS = ("input_ids", "rollout_logprobs")


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
    lengths = batch.fields.get("lengths")
    ragged = [name for name in RAGGED_COLUMNS if isinstance(batch.fields.get(name), list)]
    if lengths is None or not ragged:
        return batch
    lengths = lengths.long()
    prompt_width = int(lengths[:, 0].max())
    width = prompt_width + int(lengths[:, 1].max())
    for name in ragged:
        rows = batch.fields[name]
        dense = torch.zeros((len(rows), width), dtype=rows[0].dtype)
        for i, row in enumerate(rows):
            start = prompt_width - int(lengths[i, 0])
            dense[i, start:start + row.shape[0]] = row
        batch.fields[name] = dense
    return batch


def train_batch(columns: dict[str, Any], versions: Sequence[int]) -> TrainBatch:
    """The ``TrainBatch`` of the columns a role read (the inverse of ``rollout_columns``).

    Only ``input_ids`` and ``lengths`` are required: forward-only roles read no advantages (they
    get zeros). A ``media`` column (multimodal runs) becomes the batch's ``media`` contexts. Optional token columns of other roles (``ref_logprobs``, ``old_logprobs``,
    ``values``, ``returns``) are attached when present; ``advantages`` may be ``[B]`` (outcome
    level) or ``[B, T]`` (token level). Token columns are zeroed off the response tokens.
    """
    input_ids = columns["input_ids"].long()
    lengths = columns["lengths"].long()
    rows, width = input_ids.shape
    prompt_width = int(lengths[:, 0].max())
    column = torch.arange(width).unsqueeze(0)
    starts = (prompt_width - lengths[:, 0]).unsqueeze(1)
    ends = (prompt_width + lengths[:, 1]).unsqueeze(1)
    attention_mask = ((column >= starts) & (column < ends)).long()
    response_mask = ((column >= prompt_width) & (column < ends)).float()

    def tokens(name: str) -> torch.Tensor | None:
        value = columns.get(name)
        return None if value is None else value.float().reshape(rows, width) * response_mask

    advantages = columns.get("advantages")
    if advantages is None:
        advantages = torch.zeros(rows)
    elif advantages.numel() == rows:
        advantages = advantages.float().reshape(rows)
    else:
        advantages = tokens("advantages")
    rollout = columns.get("rollout_logprobs")
    optional = {name: tokens(name) for name in OPTIONAL_TOKEN_COLUMNS if name in columns}
    media = columns.get(MEDIA_COLUMN)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        response_mask=response_mask,
        rollout_logprobs=(rollout.float() * response_mask if rollout is not None
                          else torch.zeros(rows, width)),
        advantages=advantages,
        policy_version=torch.tensor(list(versions), dtype=torch.long),
        media=None if media is None else [str(m) for m in media],
        **optional,
    )


def token_column(batch: TrainBatch, values: torch.Tensor) -> torch.Tensor:
    """A ``[B, T]`` token tensor a role computed, in the bus layout (0 off the response tokens)."""
    return (values.float() * batch.response_mask).contiguous()
