"""Packed rows (``relax.algo.packing``): every token sees exactly the earlier tokens of its own
sample, shared prompts are held once, and log-probs come back in the padded layout from the slot
that holds each token's predecessor."""

from __future__ import annotations

import torch

from relax.algo.packing import pack_rows


def _batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int = 0):
    """The collated layout: prompts left-padded to the longest, responses from one column on."""
    width_p = max(len(p) for p in prompts)
    width = width_p + max(len(r) for r in responses)
    rows = len(prompts)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    response = torch.zeros((rows, width))
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, width_p - len(p):width_p] = torch.tensor(p)
        ids[i, width_p:width_p + len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, width_p - len(p):width_p + len(r)] = 1
        response[i, width_p:width_p + len(r)] = 1.0
    return ids, mask, (mask.cumsum(dim=1) - 1).clamp(min=0), response


PROMPTS = [[11, 12, 13], [11, 12, 13], [21, 22], [11, 12, 13], [31]]
RESPONSES = [[101, 102], [103], [104, 105, 106], [107, 108, 109, 110], [111]]


def _visible(packed, slot: int) -> list[int]:
    """The token ids a packed slot may attend to, in slot order."""
    row, col = divmod(slot, packed.input_ids.shape[1])
    allowed = packed.attention(torch.float32)[row, 0, col] == 0
    return packed.input_ids[row][allowed].tolist()


def test_every_token_sees_exactly_its_samples_earlier_tokens():
    ids, mask, positions, response = _batch(PROMPTS, RESPONSES)
    packed = pack_rows(ids, mask, positions, response, pad_id=-1)
    width = ids.shape[1]
    # the predictor of token (b, t) holds token (b, t - 1) at its position, and sees the sample up to it
    for target, predictor in zip(packed.targets.tolist(), packed.predictors.tolist()):
        b, t = divmod(target, width)
        assert packed.input_ids.view(-1)[predictor] == ids[b, t - 1]
        assert packed.position_ids.view(-1)[predictor] == positions[b, t - 1]
        assert _visible(packed, predictor) == ids[b][mask[b].bool()][:positions[b, t - 1] + 1].tolist()
    # every token with a predecessor is a target once; first tokens are not
    assert sorted(packed.targets.tolist()) == [b * width + t for b in range(len(PROMPTS)) for t in range(width)
                                               if mask[b, t] and t > 0 and mask[b, t - 1]]


def test_a_shared_prompt_is_held_once():
    ids, mask, positions, response = _batch(PROMPTS, RESPONSES)
    packed = pack_rows(ids, mask, positions, response, pad_id=-1)
    held = packed.input_ids[packed.input_ids != -1].tolist()
    assert held.count(11) == 1 and held.count(21) == 1  # three samples of [11, 12, 13], one copy
    assert len(held) == 3 + 2 + 1 + sum(len(r) for r in RESPONSES)
    assert packed.slots < ids.numel()


def test_samples_beyond_the_capacity_repeat_their_prompt():
    ids, mask, positions, response = _batch(PROMPTS, RESPONSES)
    packed = pack_rows(ids, mask, positions, response, pad_id=-1, capacity=7)
    held = packed.input_ids[packed.input_ids != -1].tolist()
    assert held.count(11) == 2  # 3 + 2 + 1 + 4 > 7: the prompt's samples take two items
    assert packed.input_ids.shape[1] == 7
    for target, predictor in zip(packed.targets.tolist(), packed.predictors.tolist()):
        b, t = divmod(target, ids.shape[1])
        assert _visible(packed, predictor) == ids[b][mask[b].bool()][:positions[b, t - 1] + 1].tolist()


def test_logprobs_come_back_padded_with_their_gradients():
    ids, mask, positions, response = _batch(PROMPTS, RESPONSES)
    packed = pack_rows(ids, mask, positions, response)
    vocab = 120
    logits = torch.randn(*packed.input_ids.shape, vocab, requires_grad=True)
    out = packed.token_logprobs(logits, temperature=0.5)
    flat = torch.log_softmax(logits.detach().reshape(-1, vocab) / 0.5, dim=-1)
    width = ids.shape[1]
    for target, predictor in zip(packed.targets.tolist(), packed.predictors.tolist()):
        b, t = divmod(target, width)
        assert torch.isclose(out[b, t], flat[predictor, ids[b, t]])
    assert (out[~mask.bool()] == 0).all()
    out.sum().backward()
    touched = logits.grad.abs().sum(dim=-1).view(-1) > 0
    assert set(touched.nonzero().view(-1).tolist()) == set(packed.predictors.tolist())
    entropy = packed.token_entropy(logits.detach(), temperature=0.5)
    for target, predictor in zip(packed.targets.tolist(), packed.predictors.tolist()):
        b, t = divmod(target, width)
        assert torch.isclose(entropy[b, t], -(flat[predictor].exp() * flat[predictor]).sum(), atol=1e-5)


def test_rows_without_responses_stand_alone():
    ids, mask, positions, response = _batch([[5, 6], [5, 6]], [[7], []])
    packed = pack_rows(ids, mask, positions, response, pad_id=-1)
    held = packed.input_ids[packed.input_ids != -1].tolist()
    assert sorted(held) == [5, 5, 6, 6, 7]  # the prompt-only row is not merged into the other's item


def test_long_rows_are_not_packed_wider_than_the_cap():
    from relax.algo.packing import WIDEST_DEFAULT

    long = list(range(1, 3001))
    ids, mask, positions, response = _batch([[7], [8], [9]], [long, long[:2500], long[:100]])
    packed = pack_rows(ids, mask, positions, response)
    assert packed.input_ids.shape[1] == max(WIDEST_DEFAULT, 3001)  # not twice the longest row
    ids, mask, positions, response = _batch([[7]], [list(range(1, 5001))])
    assert pack_rows(ids, mask, positions, response).input_ids.shape[1] == 5001  # one row wider than the cap


def test_a_prompt_that_differs_only_by_a_pad_id_token_is_not_shared():
    ids, mask, positions, response = _batch([[0, 5], [5]], [[7], [8]], pad_id=0)  # token 0 is also the pad id
    packed = pack_rows(ids, mask, positions, response, pad_id=-1)
    held = packed.input_ids[packed.input_ids != -1].tolist()
    assert sorted(held) == [0, 5, 5, 7, 8]
    for target, predictor in zip(packed.targets.tolist(), packed.predictors.tolist()):
        b, t = divmod(target, ids.shape[1])
        assert _visible(packed, predictor) == ids[b][mask[b].bool()][:positions[b, t - 1] + 1].tolist()


def test_used_slots_count_a_shared_prompt_once():
    ids, mask, positions, response = _batch(PROMPTS, RESPONSES)
    packed = pack_rows(ids, mask, positions, response, pad_id=-1)
    assert packed.used == int((packed.input_ids != -1).sum()) == 3 + 2 + 1 + sum(len(r) for r in RESPONSES)


def test_the_flex_mask_rule_is_the_dense_masks():
    ids, mask, positions, response = _batch(PROMPTS, RESPONSES)
    packed = pack_rows(ids, mask, positions, response, pad_id=-1, capacity=7)
    rows, capacity = packed.input_ids.shape
    b, q, k = torch.meshgrid(torch.arange(rows), torch.arange(capacity), torch.arange(capacity), indexing="ij")
    dense = packed.attention(torch.float32)[:, 0] == 0
    assert torch.equal(packed.allowed(b, q, k), dense)


def test_rows_past_4k_pack_into_one_wide_row_with_a_sparse_block_mask():
    """Three samples of 1,800 tokens each sharing a 500-token prompt: past ``WIDEST_DEFAULT`` the
    flex path packs them in one row of 4,608 slots (4,400 used: the prompt once), and its block
    mask keeps only the blocks the causal segments touch."""
    prompt = list(range(1, 501))
    responses = [[2000 + i] * 1300 for i in range(3)]
    ids, mask, positions, response = _batch([prompt] * 3, responses)
    packed = pack_rows(ids, mask, positions, response, capacity=4608)
    assert packed.input_ids.shape == (1, 4608) and packed.used == 4400
    block = packed.block_mask()
    blocks = 4608 // 128
    kept = int(block.kv_num_blocks.sum())
    assert kept < blocks * (blocks + 1) // 2 * 0.6  # a causal mask over one sequence would keep all of those
    assert pack_rows(ids, mask, positions, response, widest=16384).input_ids.shape == (2, 3600)  # 2 x longest
    assert pack_rows(ids, mask, positions, response).input_ids.shape[1] <= 4096  # the dense path's default
