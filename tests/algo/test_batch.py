"""Packing generations into a TrainBatch, and token log-prob alignment."""

from __future__ import annotations

import pytest
import torch

from relax.algo.batch import collate, token_logprobs
from relax.contracts import Generation

PAD = 0


def _gens():
    return [
        Generation(prompt_index=0, prompt_ids=[5, 6], response_ids=[7], logprobs=[-0.5], text="a"),
        Generation(prompt_index=1, prompt_ids=[8, 9, 10], response_ids=[11, 12, 13],
                   logprobs=[-1.0, -2.0, -3.0], text="bcd"),
    ]


def test_layout_with_varied_lengths():
    batch = collate(_gens(), [1.0, -1.0], PAD, policy_version=[3, 4])
    # prompt width 3, response width 3: [left pad][prompt][response][right pad]
    assert batch.input_ids.tolist() == [[0, 5, 6, 7, 0, 0], [8, 9, 10, 11, 12, 13]]
    assert batch.attention_mask.tolist() == [[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 0, 1, 2, 2, 2], [0, 1, 2, 3, 4, 5]]
    assert batch.response_mask.tolist() == [[0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 1]]
    assert batch.rollout_logprobs.tolist() == [[0, 0, 0, -0.5, 0, 0], [0, 0, 0, -1.0, -2.0, -3.0]]
    assert batch.advantages.tolist() == [1.0, -1.0]
    assert batch.policy_version.tolist() == [3, 4]
    assert batch.num_response_tokens == 4
    assert batch.ref_logprobs is None and batch.old_logprobs is None


def test_scalar_version_reference_logprobs_and_rounding():
    batch = collate(_gens(), torch.tensor([0.0, 0.0]), PAD, policy_version=2,
                    ref_logprobs=[[-0.1], [-0.2, -0.3, -0.4]], rewards=[1.0, 0.0], pad_to_multiple_of=4)
    assert batch.input_ids.shape == (2, 8)
    assert batch.policy_version.tolist() == [2, 2]
    assert batch.ref_logprobs[1, 3:6].tolist() == pytest.approx([-0.2, -0.3, -0.4])
    assert batch.ref_logprobs[0].tolist() == pytest.approx([0, 0, 0, -0.1, 0, 0, 0, 0])
    assert batch.rewards.tolist() == [1.0, 0.0]


def test_empty_response_row_has_no_response_tokens():
    gens = [Generation(0, [4], [], [], ""), Generation(0, [4, 5], [6], [-1.0], "x")]
    batch = collate(gens, [0.5, 0.5], PAD)
    assert batch.response_mask[0].sum().item() == 0
    assert batch.attention_mask.tolist() == [[0, 1, 0], [1, 1, 1]]


def test_mismatched_logprobs_are_rejected():
    with pytest.raises(ValueError, match="log-probs"):
        collate([Generation(0, [1], [2, 3], [-1.0], "")], [0.0], PAD)
    with pytest.raises(ValueError, match="advantages"):
        collate(_gens(), [0.0], PAD)


def test_split_trims_padding_columns_and_keeps_values():
    batch = collate(_gens(), [1.0, -1.0], PAD)
    first, second = list(batch.split(1))
    assert first.input_ids.tolist() == [[5, 6, 7]]
    assert first.position_ids.tolist() == [[0, 1, 2]]
    assert first.rollout_logprobs.tolist() == [[0, 0, -0.5]]
    assert second.input_ids.tolist() == batch.input_ids[1:].tolist()
    assert batch.used_columns() == slice(0, 6)


def test_response_values_per_row():
    batch = collate(_gens(), [1.0, -1.0], PAD)
    values = batch.response_values(batch.rollout_logprobs)
    assert [v.tolist() for v in values] == [[-0.5], [-1.0, -2.0, -3.0]]


def test_token_logprobs_alignment():
    logits = torch.tensor([[[0.0, 1.0, 2.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])  # [1, 3, vocab 3]
    ids = torch.tensor([[2, 0, 1]])
    out = token_logprobs(logits, ids)
    expected_1 = torch.log_softmax(logits[0, 0], -1)[0]  # logits at column 0 predict column 1
    expected_2 = torch.log_softmax(logits[0, 1], -1)[1]
    assert out.shape == (1, 3)
    assert out[0, 0].item() == 0.0
    assert out[0, 1].item() == pytest.approx(expected_1.item(), abs=1e-6)
    assert out[0, 2].item() == pytest.approx(expected_2.item(), abs=1e-6)


def test_token_logprobs_temperature():
    logits = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 5, (2, 4), generator=torch.Generator().manual_seed(1))
    out = token_logprobs(logits, ids, temperature=0.5)
    ref = torch.log_softmax(logits[:, :-1] / 0.5, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert torch.allclose(out[:, 1:], ref, atol=1e-6)


def test_token_advantages_as_per_generation_lists():
    batch = collate(_gens(), [[0.5], [1.0, 2.0, 3.0]], PAD, values=[[0.1], [0.2, 0.3, 0.4]],
                    returns=[[1.0], [2.0, 2.0, 2.0]])
    assert batch.advantages.tolist() == [[0, 0, 0, 0.5, 0, 0], [0, 0, 0, 1.0, 2.0, 3.0]]
    assert batch.values[1, 3:].tolist() == pytest.approx([0.2, 0.3, 0.4])
    assert batch.returns[0].tolist() == [0, 0, 0, 1.0, 0, 0]


def test_token_advantages_as_a_tensor_in_the_layout():
    adv = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    batch = collate(_gens(), adv, PAD)
    assert batch.advantages.tolist() == [[0, 0, 0, 3, 0, 0], [0, 0, 0, 9, 10, 11]]  # zeroed off the response
    with pytest.raises(ValueError, match=r"\(2, 6\)"):
        collate(_gens(), torch.zeros(2, 5), PAD)
    with pytest.raises(ValueError, match="values\\[1\\] has 2 values"):
        collate(_gens(), [0.0, 0.0], PAD, values=[[0.1], [0.2, 0.3]])


def test_select_split_and_device_keep_token_fields():
    batch = collate(_gens(), [[0.5], [1.0, 2.0, 3.0]], PAD, values=[[0.1], [0.2, 0.3, 0.4]],
                    returns=[[1.0], [2.0, 2.0, 2.0]])
    first, second = list(batch.split(1))
    # row 0 is trimmed to its 3 used columns; every token field follows the columns
    assert first.advantages.tolist() == [[0, 0, 0.5]]
    assert first.values.tolist() == [[0, 0, pytest.approx(0.1)]]
    assert first.returns.tolist() == [[0, 0, 1.0]]
    assert second.advantages.tolist() == [[0, 0, 0, 1.0, 2.0, 3.0]]
    picked = batch.select([1]).to("cpu")
    assert picked.values.shape == (1, 6) and picked.returns.shape == (1, 6)
    outcome = collate(_gens(), [1.0, -1.0], PAD)
    assert [part.advantages.tolist() for part in outcome.split(1)] == [[1.0], [-1.0]]
