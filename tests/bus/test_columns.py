"""Column packing and unpacking, without Ray: what a role writes is what it reads back."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from relax.bus import BusError, RowMeta, pad_rows
from relax.bus.columns import column_nbytes, decode_columns, encode_columns


def test_encode_keeps_dense_tensors_and_packs_lists() -> None:
    data = encode_columns(
        {
            "ids": torch.arange(6).reshape(3, 2),
            "ragged": [torch.ones(1), torch.ones(4), torch.ones(2)],
            "text": ["a", "bb", "ccc"],
        },
        num_rows=3,
    )
    assert data.batch_size == torch.Size([3])
    assert torch.equal(data["ids"], torch.arange(6).reshape(3, 2))
    assert data["ragged"].is_nested
    assert [r.shape[0] for r in data["ragged"].unbind()] == [1, 4, 2]
    assert data["text"].tolist() == ["a", "bb", "ccc"]


def test_encode_rejects_wrong_row_count_naming_the_field() -> None:
    with pytest.raises(BusError, match="'rewards' has 2 rows but the batch has 3"):
        encode_columns({"rewards": torch.zeros(2)}, num_rows=3)


def test_encode_rejects_mixed_list() -> None:
    with pytest.raises(BusError, match="mixes tensors and non-tensors"):
        encode_columns({"x": [torch.zeros(1), "a"]}, num_rows=2)


def test_decode_densifies_jagged_fields_written_dense() -> None:
    rows = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
    returned = TensorDict({"x": torch.nested.nested_tensor(rows, layout=torch.jagged)}, batch_size=[2])
    schema = {"x": {"is_nested": False, "is_non_tensor": False}}
    out = decode_columns(returned, schema, ["x"])
    assert isinstance(out["x"], torch.Tensor) and not out["x"].is_nested
    assert torch.equal(out["x"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))


def test_decode_refuses_dense_field_with_unequal_rows() -> None:
    rows = [torch.zeros(2), torch.zeros(3)]
    returned = TensorDict({"x": torch.nested.nested_tensor(rows, layout=torch.jagged)}, batch_size=[2])
    with pytest.raises(BusError, match="list of tensors"):
        decode_columns(returned, {"x": {"is_nested": False}}, ["x"])


def test_pad_rows_right_and_left() -> None:
    rows = [torch.tensor([1, 2, 3]), torch.tensor([4])]
    right, lengths = pad_rows(rows, pad_value=-1, side="right")
    left, _ = pad_rows(rows, pad_value=-1, side="left")
    assert torch.equal(right, torch.tensor([[1, 2, 3], [4, -1, -1]]))
    assert torch.equal(left, torch.tensor([[1, 2, 3], [-1, -1, 4]]))
    assert torch.equal(lengths, torch.tensor([3, 1]))


def test_pad_rows_refuses_rows_ragged_beyond_first_dim() -> None:
    with pytest.raises(BusError, match="differ only in their first dimension"):
        pad_rows([torch.zeros(2, 3), torch.zeros(2, 4)])


def test_column_nbytes_counts_tensor_payload() -> None:
    assert column_nbytes(torch.zeros(4, 8, dtype=torch.float32)) == 128
    assert column_nbytes([torch.zeros(3, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)]) == 32
    assert column_nbytes(["strings", "count", "zero"]) == 0


def test_row_meta_round_trips_through_its_tag() -> None:
    trace = {"traceparent": "00-ab-cd-01"}
    meta = RowMeta(policy_version=3, sample_id="p1-s0", trace=trace, extra={"group": 1})
    tag = meta.to_tag()
    assert tag == {"policy_version": 3, "sample_id": "p1-s0", "trace": trace, "group": 1}
    assert RowMeta.from_tag(tag) == meta


def test_row_meta_requires_version_and_id() -> None:
    with pytest.raises(BusError, match=r"\['sample_id'\]"):
        RowMeta.coerce({"policy_version": 0})
