"""Packed rows: a padded token batch laid out without padding and with each shared prompt once.

A training batch is padded to its longest prompt plus its longest response
(``relax.algo.batch``), so every row pays for the longest one, and GRPO's ``n`` samples of a prompt
each carry that prompt again. ``pack_rows`` lays the batch out as a few packed rows of
``capacity`` columns instead: the samples of one prompt become one *item*, the prompt's tokens once
followed by each sample's response, and items sit side by side (best fit, largest first). The
attention mask (``PackedRows.attention``) lets a response token see its own response and its
prompt, causally, and nothing else; positions are each token's own. A forward pass over the packed
rows therefore gives every token the hidden state it has in the padded batch, on far fewer token
slots: on the tiny CPU preset (4 prompt and about 3 response tokens a sample, 8 samples a prompt)
less than half of them.

``PackedRows.token_logprobs`` and ``token_entropy`` read the packed logits back in the padded
layout: entry ``(b, t)`` is computed from the logits of the slot that holds token ``(b, t - 1)``
(a shared prompt's last token predicts every sample's first response token), 0 where a token has no
predecessor in its row and at padding. Both are differentiable, so the loss's gradient reaches every
slot, a shared prompt's summed over its samples exactly as over the padded rows.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

WIDEST_DEFAULT = 4096
"""The default capacity stops growing here (unless one row is longer) when the dense mask is used:
it is ``capacity x capacity`` per packed row, 32 MB in bfloat16 at 4096 columns against 512 MB at
16384. With ``block_mask`` (flex attention: only the mask's non-empty 128 x 128 blocks are computed
and stored) a caller passes a wider ``widest`` to ``pack_rows``."""


@dataclass(frozen=True)
class PackedRows:
    """The packed layout of a ``[B, T]`` batch and the maps between the two layouts."""

    input_ids: Tensor
    """``[rows, capacity]`` token ids; unused slots hold ``pad_id``."""
    position_ids: Tensor
    """``[rows, capacity]`` each token's position in its own sample; 0 in unused slots."""
    segment: Tensor
    """``[rows, capacity]`` which segment (a prompt, or one sample's response) a slot belongs to."""
    context: Tensor
    """``[rows, capacity]`` the segment a slot may also attend to: a response slot's prompt (a
    prompt slot's own segment)."""
    targets: Tensor
    """Flat ``[B * T]`` indices of the tokens that have a predecessor in their row."""
    predictors: Tensor
    """Flat ``[rows * capacity]`` index of the slot whose logits predict each of ``targets``."""
    target_ids: Tensor
    """The token id at each of ``targets``."""
    shape: tuple[int, int]
    """``(B, T)``: the padded layout."""
    used: int = 0
    """Slots that hold a token (a shared prompt's once); the rest are padding (``pad_frac``)."""

    @property
    def slots(self) -> int:
        return self.input_ids.numel()

    def attention(self, dtype: torch.dtype) -> Tensor:
        """The ``[rows, 1, capacity, capacity]`` additive mask (0 where a query slot may attend to a
        key slot, the dtype's lowest value elsewhere): causal, within a segment or from a response
        to its prompt."""
        capacity = self.input_ids.shape[1]
        keys, queries = self.segment.unsqueeze(1), self.segment.unsqueeze(2)
        allowed = (keys == queries) | (keys == self.context.unsqueeze(2))
        allowed &= torch.ones(capacity, capacity, dtype=torch.bool, device=allowed.device).tril()
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)

    def allowed(self, row: Tensor, query: Tensor, key: Tensor) -> Tensor:
        """Whether slot ``query`` of packed row ``row`` may attend to slot ``key`` (the rule of
        ``attention``, elementwise): causal, within a segment or from a response to its prompt. The
        ``mask_mod`` of flex attention."""
        own, seen = self.segment[row, query], self.context[row, query]
        other = self.segment[row, key]
        return ((other == own) | (other == seen)) & (key <= query)

    def block_mask(self, block_size: int = 128) -> Any:
        """The mask as a flex-attention ``BlockMask`` (``torch.nn.attention.flex_attention``): the
        variable-length path, whose memory grows with the blocks the segments touch rather than with
        ``capacity ** 2``, so packed rows can be far wider than ``WIDEST_DEFAULT``. Flex attention
        has no backward on CPU (torch 2.13); there ``attention`` is the fallback."""
        from torch.nn.attention.flex_attention import create_block_mask

        rows, capacity = self.input_ids.shape

        def mask_mod(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            return self.allowed(b, q, k)

        return create_block_mask(mask_mod, B=rows, H=None, Q_LEN=capacity, KV_LEN=capacity,
                                 device=self.input_ids.device, BLOCK_SIZE=block_size)

    def token_logprobs(self, logits: Tensor, temperature: float = 1.0) -> Tensor:
        """``[B, T]`` float32 log-probs in the padded layout from ``[rows, capacity, V]`` logits."""
        scaled = logits.reshape(self.slots, -1).float()
        if temperature != 1.0:
            scaled = scaled / temperature
        picked = scaled[self.predictors, self.target_ids] - torch.logsumexp(scaled, dim=-1)[self.predictors]
        return self._place(picked)

    def token_entropy(self, logits: Tensor, temperature: float = 1.0) -> Tensor:
        """``[B, T]`` entropies of the distribution each token was drawn from, like ``token_logprobs``."""
        scaled = logits.reshape(self.slots, -1).float()
        if temperature != 1.0:
            scaled = scaled / temperature
        logp = torch.log_softmax(scaled, dim=-1)
        return self._place(-(logp.exp() * logp).sum(dim=-1)[self.predictors])

    def _place(self, values: Tensor) -> Tensor:
        rows, width = self.shape
        return values.new_zeros(rows * width).index_copy(0, self.targets, values).view(rows, width)


def pack_rows(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, response_mask: Tensor,
              pad_id: int = 0, capacity: int | None = None, widest: int = WIDEST_DEFAULT) -> PackedRows:
    """Pack a batch in ``relax.algo.batch``'s layout (real tokens contiguous in each row, every
    response starting at the same column): rows whose prompts are the same tokens share one copy
    of the prompt. ``capacity`` defaults to twice the longest row (at least 64; at most
    ``widest`` or the longest row, whichever is wider; at most what all the tokens need), so
    the attention mask of a packed row stays within a few padded rows' while most items fit; a
    prompt whose samples do not fit one packed row is repeated in as many as they need. A row is
    never split."""
    rows, width = input_ids.shape
    device = input_ids.device
    real = attention_mask.bool()
    lengths = real.sum(dim=1)
    first = real.int().argmax(dim=1)
    responded = response_mask.bool().any(dim=0).nonzero()
    # Every response starts at the same column; rows with no response tokens are prompts only.
    boundary = int(responded[0]) if responded.numel() else width
    prompt_len = ((boundary - first).clamp(min=0)).minimum(lengths)
    response_len = lengths - prompt_len
    longest = int(lengths.max()) if rows else 0

    chosen_capacity = capacity
    capacity = max(int(capacity or min(max(2 * longest, 64), widest)), longest, 1)

    # Items: a prompt and the responses of its samples (rows of the same prompt tokens).
    # A prompt's key is its tokens with -1 for padding (a pad id may also be a real token).
    key = torch.where(real[:, :boundary], input_ids[:, :boundary], -1)
    _, group = torch.unique(key, dim=0, return_inverse=True)
    p_len, r_len, groups = prompt_len.tolist(), response_len.tolist(), group.tolist()
    members: dict[int, list[int]] = {}
    for row in range(rows):
        members.setdefault(groups[row] if r_len[row] else -1 - row, []).append(row)
    items: list[list[int]] = []
    for rows_of in members.values():
        size = p_len[rows_of[0]]
        chunk: list[int] = []
        for row in rows_of:
            if chunk and size + r_len[row] > capacity:
                items.append(chunk)
                chunk, size = [], p_len[rows_of[0]]
            chunk.append(row)
            size += r_len[row]
        items.append(chunk)
    sizes = [p_len[item[0]] + sum(r_len[r] for r in item) for item in items]
    if chosen_capacity is None:  # no wider than everything needs
        capacity = max(min(capacity, sum(sizes)), longest, 1)

    # Best fit, largest first: each item goes to the packed row with the least room that holds it.
    rooms: list[tuple[int, int]] = []
    count = 0
    prompt_at, response_at = [0] * rows, [0] * rows
    segment_of_prompt, segment_of_response = [0] * rows, [0] * rows
    segments = 0
    for index in sorted(range(len(items)), key=lambda i: -sizes[i]):
        at = bisect.bisect_left(rooms, (sizes[index], -1))
        if at < len(rooms):
            room, bin_ = rooms.pop(at)
        else:
            room, bin_, count = capacity, count, count + 1
        bisect.insort(rooms, (room - sizes[index], bin_))
        item = items[index]
        start = bin_ * capacity + capacity - room
        prompt_segment, segments = segments, segments + 1
        offset = start + p_len[item[0]]
        for row in item:
            prompt_at[row], segment_of_prompt[row] = start, prompt_segment
            response_at[row], segment_of_response[row] = offset, segments
            offset += r_len[row]
            segments += 1

    row_index, column = real.nonzero(as_tuple=True)
    in_prompt = column < boundary
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    slot = torch.where(in_prompt, as_tensor(prompt_at)[row_index] + column - first[row_index],
                       as_tensor(response_at)[row_index] + column - boundary)
    own = torch.where(in_prompt, as_tensor(segment_of_prompt)[row_index], as_tensor(segment_of_response)[row_index])
    seen = as_tensor(segment_of_prompt)[row_index]
    slots = count * capacity
    flat = row_index * width + column
    packed_ids = input_ids.new_full((slots,), pad_id).index_copy(0, slot, input_ids.reshape(-1)[flat])
    positions = position_ids.new_zeros(slots).index_copy(0, slot, position_ids.reshape(-1)[flat])
    # Unused slots each get a segment of their own (they attend to themselves only).
    spare = torch.arange(segments, segments + slots, device=device)
    segment = spare.clone().index_copy(0, slot, own)
    context = spare.index_copy(0, slot, seen)
    has_predecessor = column > first[row_index]
    # The slot of token (b, t - 1): real tokens are listed row by row, left to right.
    predictors = torch.cat([slot[:1], slot[:-1]])[has_predecessor]
    return PackedRows(input_ids=packed_ids.view(count, capacity), position_ids=positions.view(count, capacity),
                      segment=segment.view(count, capacity), context=context.view(count, capacity),
                      targets=flat[has_predecessor], predictors=predictors,
                      target_ids=input_ids.reshape(-1)[flat[has_predecessor]], shape=(rows, width),
                      used=int(torch.unique(slot).numel()))
