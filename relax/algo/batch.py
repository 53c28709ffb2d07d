"""The training batch: generations packed into padded tensors, and token log-probs.

Layout of one row (``T = P + R`` columns, ``P`` the longest prompt, ``R`` the longest response)::

    [left pad][prompt ids][response ids][right pad]
     <------- P -------><------- R ------->

Every prompt ends at column ``P - 1`` and every response starts at column ``P``. Token-aligned
tensors use one convention throughout: entry ``t`` belongs to the token at column ``t``, and a
log-prob at ``t`` is ``log p(input_ids[t] | input_ids[<t])`` (entry 0 has no context and is 0).

``position_ids = max(cumsum(attention_mask) - 1, 0)``: the first real token of each row is position
0 whatever its left padding, exactly as Hugging Face ``generate`` numbers a left-padded prompt, so
the training forward reproduces the log-probs of generation.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from relax.contracts import Generation
from relax.roles import OPTIONAL_TOKEN_COLUMNS, Column


class TakenRows(Protocol):
    """Rows a role took from the bus (``relax.bus.BusBatch`` is one): its columns, and per row its
    metadata with the ``policy_version`` that generated it. A protocol, so ``relax.algo`` needs
    nothing of the bus."""

    fields: Mapping[str, Any]
    meta: Sequence[Any]

__all__ = ["TrainBatch", "collate", "pack_tokens", "token_logprobs"]


@dataclass
class TrainBatch:
    """Padded tensors of ``B`` samples over ``T`` token columns (see the module docstring)."""

    input_ids: Tensor
    """``[B, T]`` int64 token ids; padding holds the pad token."""
    attention_mask: Tensor
    """``[B, T]`` int64: 1 on prompt and response tokens, 0 on padding."""
    position_ids: Tensor
    """``[B, T]`` int64: ``max(cumsum(attention_mask) - 1, 0)``."""
    response_mask: Tensor
    """``[B, T]`` float32: 1 on response tokens (the tokens the policy chose), 0 elsewhere."""
    rollout_logprobs: Tensor
    """``[B, T]`` float32: the behaviour policy's log-prob of each response token (0 elsewhere)."""
    advantages: Tensor
    """``[B]`` float32, one advantage per sample applied to all its response tokens (outcome-level
    estimators), or ``[B, T]`` float32, one per token and 0 off the response (token-level ones)."""
    policy_version: Tensor
    """``[B]`` int64: the policy version that generated each sample."""
    ref_logprobs: Tensor | None = None
    """``[B, T]`` float32: the reference policy's token log-probs (for a KL penalty), if computed."""
    old_logprobs: Tensor | None = None
    """``[B, T]`` float32: a proximal ("old") policy's token log-probs recomputed by the trainer, if
    any; when absent the behaviour log-probs serve as the old policy."""
    rewards: Tensor | None = None
    """``[B]`` float32: the scalar rewards (for metrics), if given."""
    values: Tensor | None = None
    """``[B, T]`` float32: the critic's values at the response tokens (entry ``t`` is the value of
    the state in which token ``t`` was chosen) that the advantages were computed with, if any."""
    returns: Tensor | None = None
    """``[B, T]`` float32: the critic's value targets (e.g. GAE's ``advantages + values``), if any."""
    token_versions: Tensor | None = None
    """``[B, T]`` int64: agentic runs, the policy version that chose each token (0 elsewhere)."""
    routed_experts: Tensor | None = None
    """``[B, T, layers, k]`` integer: MoE runs replaying the rollout's routing
    (``algorithm.router_replay: r3``), per response token the experts each MoE layer's router chose
    in the forward pass that gave its distribution (``relax.contracts.Generation.routed_experts``);
    0 off the response. Kept aligned with the rows and columns like the token tensors."""
    media: list[str] | None = None
    """Per row, a multimodal sample's context as JSON (its prompt text and media references,
    ``relax.media``), from which a trainer rebuilds the model's media inputs; None for text runs.
    The only non-tensor field: ``select`` keeps it aligned with the rows, the column operations
    leave it as it is."""

    @classmethod
    def from_bus(cls, batch: TakenRows) -> TrainBatch:
        """The batch of the rows a role took from the bus (``relax.bus.BusBatch``), each row's
        ``policy_version`` from its metadata: the one conversion between the bus and a trainer."""
        return cls.from_columns(batch.fields, [m.policy_version for m in batch.meta])

    @classmethod
    def from_columns(cls, columns: Mapping[str, Any], versions: Sequence[int]) -> TrainBatch:
        """The batch of a step's bus columns (``relax.roles.Column``; the rollout writes the token
        columns densely in this module's layout, ``pack_tokens``), read from the bus or still in
        the memory of the worker that made them.

        Only ``input_ids`` and ``lengths`` (``[B, 2]``: prompt and response tokens per row) are
        required: forward-only roles read no advantages (they get zeros). A ``media`` column
        (multimodal runs) becomes the batch's ``media`` contexts. Token columns of other roles
        (``ref_logprobs``, ``old_logprobs``, ``values``, ``returns``) are attached when present;
        ``advantages`` may be ``[B]`` (outcome level) or ``[B, T]`` (token level). Token columns
        are zeroed off the response tokens.
        """
        input_ids = columns[Column.input_ids].long()
        lengths = columns[Column.lengths].long()
        rows, width = input_ids.shape
        prompt_width = int(lengths[:, 0].max())
        column = torch.arange(width).unsqueeze(0)
        starts = (prompt_width - lengths[:, 0]).unsqueeze(1)
        ends = (prompt_width + lengths[:, 1]).unsqueeze(1)
        attention_mask = ((column >= starts) & (column < ends)).long()
        response_mask = ((column >= prompt_width) & (column < ends)).float()
        loss_mask = columns.get(Column.loss_mask)
        if loss_mask is not None:  # agentic: only the tokens the policy chose are its response
            response_mask = response_mask * loss_mask.float().reshape(rows, width)

        def tokens(name: str) -> Tensor | None:
            value = columns.get(name)
            return None if value is None else value.float().reshape(rows, width) * response_mask

        advantages = columns.get(Column.advantages)
        if advantages is None:
            advantages = torch.zeros(rows)
        elif advantages.numel() == rows:
            advantages = advantages.float().reshape(rows)
        else:
            advantages = tokens(Column.advantages)
        rollout = columns.get(Column.rollout_logprobs)
        optional = {str(name): tokens(name) for name in OPTIONAL_TOKEN_COLUMNS if name in columns}
        media = columns.get(Column.media)
        versions_column = columns.get(Column.token_versions)
        routed = columns.get(Column.routed_experts)
        if routed is not None:
            routed = routed.reshape(rows, width, *routed.shape[-2:])
        return cls(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=(attention_mask.cumsum(dim=1) - 1).clamp(min=0),
            response_mask=response_mask,
            rollout_logprobs=(rollout.float() * response_mask if rollout is not None
                              else torch.zeros(rows, width)),
            advantages=advantages,
            policy_version=torch.tensor(list(versions), dtype=torch.long),
            media=None if media is None else [str(m) for m in media],
            token_versions=None if versions_column is None else versions_column.long().reshape(rows, width),
            routed_experts=routed,
            **optional,
        )

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum().item())

    def _tensors(self) -> dict[str, Tensor | None]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "media"}

    def select(self, rows: slice | Sequence[int] | Tensor) -> TrainBatch:
        """The batch restricted to some rows (columns are kept; see ``trim``)."""
        if not isinstance(rows, slice):
            rows = torch.as_tensor(rows, dtype=torch.long)
        media = self.media
        if media is not None:
            media = media[rows] if isinstance(rows, slice) else [media[int(i)] for i in rows.reshape(-1)]
        return TrainBatch(**{k: None if v is None else v[rows] for k, v in self._tensors().items()}, media=media)

    def used_columns(self) -> slice:
        """The columns from the first to the last that is not padding in some row."""
        used = self.attention_mask.any(dim=0).nonzero()
        if used.numel() == 0:
            return slice(0, self.input_ids.shape[1])
        return slice(int(used[0]), int(used[-1]) + 1)

    def select_columns(self, columns: slice) -> TrainBatch:
        """The batch restricted to some token columns (per-row fields are kept)."""
        return TrainBatch(**{
            k: v if v is None or v.ndim == 1 else v[:, columns] for k, v in self._tensors().items()
        }, media=self.media)

    def trim(self) -> TrainBatch:
        """Drop leading and trailing columns that are padding in every row.

        Position ids are stored, so dropping left padding changes no log-prob.
        """
        columns = self.used_columns()
        if columns.start == 0 and columns.stop == self.input_ids.shape[1]:
            return self
        return self.select_columns(columns)

    def split(self, rows_per_part: int) -> Iterator[TrainBatch]:
        """Consecutive parts of at most ``rows_per_part`` rows, each trimmed of padding columns."""
        for _, _, part in self.parts(rows_per_part):
            yield part

    def parts(self, rows_per_part: int) -> Iterator[tuple[slice, slice, TrainBatch]]:
        """Consecutive parts of at most ``rows_per_part`` rows, each trimmed of padding columns, with
        the rows and columns of this batch each one holds (where a per-part result goes back)."""
        if rows_per_part < 1:
            raise ValueError(f"rows_per_part must be >= 1, got {rows_per_part}")
        for start in range(0, self.batch_size, rows_per_part):
            rows = slice(start, start + rows_per_part)
            part = self.select(rows)
            columns = part.used_columns()
            yield rows, columns, part.select_columns(columns)

    def to(self, device: str | torch.device) -> TrainBatch:
        return TrainBatch(**{k: None if v is None else v.to(device) for k, v in self._tensors().items()},
                          media=self.media)

    def with_fields(self, **changes: Tensor | None) -> TrainBatch:
        """A copy with some fields replaced (e.g. ``old_logprobs`` after a recompute)."""
        return replace(self, **changes)

    def response_values(self, values: Tensor) -> list[Tensor]:
        """The entries of a ``[B, T]`` token tensor on each row's response tokens, row by row."""
        mask = self.response_mask.bool()
        return [values[i][mask[i]] for i in range(self.batch_size)]


def _per_row(value: int | Sequence[int] | Tensor, rows: int, name: str) -> Tensor:
    tensor = torch.as_tensor(value)
    if tensor.ndim == 0:
        tensor = tensor.expand(rows).clone()
    if tensor.shape != (rows,):
        raise ValueError(f"{name} must be a scalar or have one entry per generation ({rows}), "
                         f"got shape {tuple(tensor.shape)}")
    return tensor


def collate(
    generations: Sequence[Generation],
    advantages: Tensor | Sequence[float] | Sequence[Sequence[float]],
    pad_token_id: int,
    *,
    policy_version: int | Sequence[int] | Tensor = 0,
    ref_logprobs: Sequence[Sequence[float]] | None = None,
    rewards: Tensor | Sequence[float] | None = None,
    pad_to_multiple_of: int = 1,
    values: Sequence[Sequence[float]] | None = None,
    returns: Sequence[Sequence[float]] | None = None,
) -> TrainBatch:
    """Pack generations into a ``TrainBatch``.

    ``advantages`` has one value per generation (``[B]``), or one per response token: a sequence of
    per-generation sequences like ``Generation.logprobs``, or a ``[B, T]`` tensor already in this
    function's layout. ``policy_version`` is one version for all or one per generation.
    ``ref_logprobs``, ``values`` and ``returns`` (optional) hold, per generation, one value per
    response token, like ``Generation.logprobs``. ``pad_to_multiple_of`` rounds the number of
    columns up (the extra columns are right padding).
    """
    input_ids, rollout_logprobs = pack_tokens(generations, pad_token_id, pad_to_multiple_of)
    rows, width = input_ids.shape
    prompt_width = max(len(g.prompt_ids) for g in generations)
    attention_mask = torch.zeros((rows, width), dtype=torch.long)
    response_mask = torch.zeros((rows, width), dtype=torch.float32)
    for i, g in enumerate(generations):
        end = prompt_width + len(g.response_ids)
        attention_mask[i, prompt_width - len(g.prompt_ids):end] = 1
        response_mask[i, prompt_width:end] = 1.0 if g.loss_mask is None else torch.tensor(g.loss_mask,
                                                                                           dtype=torch.float32)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)

    def token_rows(per_row: Sequence[Sequence[float]] | None, name: str) -> Tensor | None:
        if per_row is None:
            return None
        if len(per_row) != rows:
            raise ValueError(f"{name} must have one entry per generation ({rows}), got {len(per_row)}")
        out = torch.zeros((rows, width), dtype=torch.float32)
        for i, g in enumerate(generations):
            row = torch.as_tensor(per_row[i], dtype=torch.float32).detach().cpu().reshape(-1)
            if row.numel() != len(g.response_ids):
                raise ValueError(f"{name}[{i}] has {row.numel()} values but generation {i} has "
                                 f"{len(g.response_ids)} response tokens; give one per response token")
            out[i, prompt_width:prompt_width + row.numel()] = row
        return out

    if isinstance(advantages, Tensor) and advantages.ndim == 2:
        adv = advantages.detach().to(torch.float32).cpu()
        if adv.shape != (rows, width):
            raise ValueError(f"token advantages must have shape ({rows}, {width}) in the collated "
                             f"layout, got {tuple(adv.shape)}; or give one sequence per generation")
        adv = adv * response_mask
    elif not isinstance(advantages, Tensor) and rows and isinstance(advantages[0], Sequence):
        adv = token_rows(advantages, "advantages")  # type: ignore[arg-type]
    else:
        adv = torch.as_tensor(advantages, dtype=torch.float32).detach().cpu()
        if adv.shape != (rows,):
            raise ValueError(f"advantages must have one value per generation ({rows}), got shape {tuple(adv.shape)}")
    versions = _per_row(policy_version, rows, "policy_version").to(torch.long)
    rew = None
    if rewards is not None:
        rew = torch.as_tensor(rewards, dtype=torch.float32).detach().cpu()
        if rew.shape != (rows,):
            raise ValueError(f"rewards must have one value per generation ({rows}), got shape {tuple(rew.shape)}")
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask,
        rollout_logprobs=rollout_logprobs,
        advantages=adv,
        policy_version=versions,
        ref_logprobs=token_rows(ref_logprobs, "ref_logprobs"),
        rewards=rew,
        values=token_rows(values, "values"),
        returns=token_rows(returns, "returns"),
    )


def pack_tokens(generations: Sequence[Generation], pad_token_id: int,
                pad_to_multiple_of: int = 1) -> tuple[Tensor, Tensor]:
    """The generations' ``input_ids`` and ``rollout_logprobs`` in this module's layout (``[B, T]``
    each): what ``collate`` packs, and the dense token columns the rollout puts on the bus."""
    rows = len(generations)
    if rows == 0:
        raise ValueError("collate needs at least one generation")
    for i, g in enumerate(generations):
        if len(g.logprobs) != len(g.response_ids):
            raise ValueError(f"generation {i} has {len(g.response_ids)} response tokens but "
                             f"{len(g.logprobs)} log-probs; give one log-prob per response token")
        if not g.prompt_ids:
            raise ValueError(f"generation {i} has an empty prompt; every row needs a prompt token")
    prompt_lengths = np.fromiter((len(g.prompt_ids) for g in generations), dtype=np.int64, count=rows)
    response_lengths = np.fromiter((len(g.response_ids) for g in generations), dtype=np.int64, count=rows)
    prompt_width = int(prompt_lengths.max())
    width = prompt_width + int(response_lengths.max())
    width += -width % max(1, pad_to_multiple_of)
    input_ids = np.full((rows, width), pad_token_id, dtype=np.int64)
    rollout_logprobs = np.zeros((rows, width), dtype=np.float32)
    # One array per kind for the whole batch, scattered to (row, column) at once, in numpy: a tensor
    # per row and kind cost more than the rest of the step's bookkeeping together, and torch's
    # per-call overhead on these small index tensors was most of this function's time.
    prompt_rows, prompt_cols = _positions(prompt_lengths, prompt_width - prompt_lengths)
    input_ids[prompt_rows, prompt_cols] = _flat((g.prompt_ids for g in generations), np.int64, prompt_lengths)
    if int(response_lengths.sum()):
        rows_, cols = _positions(response_lengths, np.full(rows, prompt_width, dtype=np.int64))
        input_ids[rows_, cols] = _flat((g.response_ids for g in generations), np.int64, response_lengths)
        rollout_logprobs[rows_, cols] = _flat((g.logprobs for g in generations), np.float32, response_lengths)
    return torch.from_numpy(input_ids), torch.from_numpy(rollout_logprobs)


def pack_response_values(generations: Sequence[Generation], values: Sequence[Sequence[int]], width: int,
                         dtype: torch.dtype) -> Tensor:
    """Per-response-token values (a loss mask, token versions) in this module's ``[B, T]`` layout,
    0 off the response: the dense form of the agentic token columns."""
    rows = len(generations)
    prompt_width = max(len(g.prompt_ids) for g in generations)
    lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=rows)
    out = torch.zeros((rows, width), dtype=dtype)
    if int(lengths.sum()):
        rows_, cols = _positions(lengths, np.full(rows, prompt_width, dtype=np.int64))
        out[torch.from_numpy(rows_), torch.from_numpy(cols)] = torch.tensor([x for v in values for x in v], dtype=dtype)
    return out


def _positions(lengths: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows of ``lengths`` tokens placed from column ``starts``: each token's row and column, in
    row order (the order of the rows' tokens concatenated)."""
    rows = np.repeat(np.arange(len(lengths)), lengths)
    first = np.cumsum(lengths) - lengths  # where each row begins in the concatenation
    within = np.arange(int(lengths.sum())) - np.repeat(first, lengths)
    return rows, starts[rows] + within


def _flat(per_row: Iterator[Sequence[Any]], dtype: Any, lengths: np.ndarray) -> np.ndarray:
    """The rows' values concatenated, as one array of ``dtype`` (``lengths``: each row's count)."""
    return np.fromiter(itertools.chain.from_iterable(per_row), dtype=dtype, count=int(lengths.sum()))


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Token log-probs aligned to token positions, in float32.

    ``out[b, t] = log softmax(logits[b, t-1] / temperature)[input_ids[b, t]]`` for ``t >= 1``, and
    ``out[b, 0] = 0``: ``logits[b, t]`` (a causal LM's output at column ``t``) predicts the token at
    column ``t + 1``. Computed as ``gathered logit - logsumexp`` so no ``[B, T, V]`` log-softmax is
    materialized beyond the float32 logits.
    """
    if logits.shape[:2] != input_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and input_ids {tuple(input_ids.shape)} disagree")
    scaled = logits[:, :-1].float()
    if temperature != 1.0:
        scaled = scaled / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    picked = scaled.gather(-1, targets).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    return torch.nn.functional.pad(picked, (1, 0), value=0.0)
