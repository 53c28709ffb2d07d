"""Column packing and unpacking, without Ray: what a role writes is what it reads back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relax.bus import BusError, RowMeta, pad_rows
from relax.bus.columns import column_nbytes
from relax.bus.payloads import encode_columns, pack_columns, unpack


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


def _round_trip(columns: dict, num_rows: int, rows: list[int] | None = None) -> dict:
    """Pack as a put would, then take ``rows`` (all, in order, by default) as a get would."""
    packed = pack_columns(columns, num_rows)
    if rows is None:
        pieces = [(0, None, None)]
    else:
        pieces = [(0, np.asarray(rows), np.arange(len(rows)))]
    n = num_rows if rows is None else len(rows)
    return {name: unpack(name, [packed], pieces, n) for name in columns}


def test_payload_columns_come_back_as_the_kind_written() -> None:
    images = [torch.rand(3, 4, 5), torch.rand(3, 2, 2)]
    columns = {"ids": torch.arange(6).reshape(2, 3), "half": torch.randn(2, 4).to(torch.bfloat16),
               "ragged": [torch.arange(4), torch.arange(1)], "images": images, "text": ["a", {"b": 1}],
               "scalars": [torch.tensor(1.5), torch.tensor(2.5)]}
    out = _round_trip(columns, 2)
    assert torch.equal(out["ids"], columns["ids"])
    assert out["half"].dtype == torch.bfloat16 and torch.equal(out["half"], columns["half"])
    assert [r.tolist() for r in out["ragged"]] == [[0, 1, 2, 3], [0]]
    assert all(torch.equal(a, b) for a, b in zip(out["images"], images))
    assert out["text"] == ["a", {"b": 1}]
    assert torch.equal(out["scalars"], torch.tensor([1.5, 2.5]))


def test_payload_rows_are_taken_in_the_readers_order_and_writable() -> None:
    out = _round_trip({"x": torch.arange(8).reshape(4, 2), "r": [torch.arange(i + 1) for i in range(4)],
                       "t": ["a", "b", "c", "d"]}, 4, rows=[3, 0, 2])
    assert out["x"].tolist() == [[6, 7], [0, 1], [4, 5]]
    assert [len(r) for r in out["r"]] == [4, 1, 3] and out["t"] == ["d", "a", "c"]
    out["x"][0, 0] = 100  # a reader's copy: changing it changes nothing on the bus
    assert out["x"][0, 0] == 100


def test_payload_rows_of_different_widths_come_back_one_tensor_per_row() -> None:
    first, second = pack_columns({"x": torch.zeros(2, 3)}, 2), pack_columns({"x": torch.ones(1, 5)}, 1)
    pieces = [(0, np.arange(2), np.array([0, 2])), (1, np.arange(1), np.array([1]))]
    out = unpack("x", [first, second], pieces, 3)
    assert [tuple(r.shape) for r in out] == [(3,), (5,), (3,)]


def test_pack_rejects_wrong_row_counts_and_mixed_lists() -> None:
    with pytest.raises(BusError, match="'rewards' has 2 rows but the batch has 3"):
        pack_columns({"rewards": torch.zeros(2)}, 3)
    with pytest.raises(BusError, match="mixes tensors and non-tensors"):
        pack_columns({"x": [torch.zeros(1), "a"]}, 2)
    with pytest.raises(BusError, match="0-d tensor"):
        pack_columns({"x": torch.tensor(1.0)}, 1)


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
    back = RowMeta.from_tag(tag)
    assert back == meta
    assert tag["sample_id"] == "p1-s0" and "group" in tag  # the tag is read, not emptied
    back.trace["tracestate"] = "x"  # each row owns its carrier and extras
    back.extra["group"] = 2
    assert tag["trace"] == {"traceparent": "00-ab-cd-01"} and tag["group"] == 1


def test_row_meta_requires_version_and_id() -> None:
    with pytest.raises(BusError, match=r"\['sample_id'\]"):
        RowMeta.coerce({"policy_version": 0})
