"""The bus against a real local Ray and a real TransferQueue.

One Ray + TransferQueue per module (about 10 s to start); each test uses its own partition so
tests stay independent of their order.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import ray
import torch

from relax.bus import Bus, BusBatch, BusError, BusTimeout, RowMeta


@pytest.fixture(scope="module")
def bus() -> Iterator[Bus]:
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    handle = Bus.start()
    yield handle
    handle.close()
    if started_ray:
        ray.shutdown()


@pytest.fixture
def partition() -> str:
    return f"step-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=["by_value", "by_reference"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """How this process's puts reach the keeper: small payloads by value (the default for these
    sizes), or every payload through the object store. Returns the ``INLINE_BYTES`` in force."""
    from relax.bus import payloads

    if request.param == "by_reference":
        monkeypatch.setattr(payloads, "INLINE_BYTES", -1)
    return payloads.INLINE_BYTES


def _meta(n: int, version: int = 0, prefix: str = "s") -> list[RowMeta]:
    return [RowMeta(policy_version=version, sample_id=f"{prefix}{i}") for i in range(n)]


def _put_numbered(bus: Bus, partition: str, n: int) -> None:
    """Rows whose ``idx`` field equals their position, so tests can tell rows apart."""
    bus.put(partition, {"idx": torch.arange(n)}, _meta(n))


def test_put_get_round_trip_keeps_values_dtypes_and_shapes(bus: Bus, partition: str, way: int) -> None:
    columns = {
        "input_ids": torch.randint(0, 300, (4, 6), dtype=torch.int64),
        "response_mask": torch.rand(4, 6) > 0.5,
        "rollout_logprobs": -torch.rand(4, 6, dtype=torch.float32),
        "hidden": torch.randn(4, 2, 3, dtype=torch.bfloat16),
        "rewards": torch.tensor([0.0, 1.0, 0.5, -1.0]),
        "label": ["7", "12", "x", ""],
    }
    bus.put(partition, columns, _meta(4))
    batch = bus.get(partition, list(columns), task="actor", batch_size=4, timeout_s=10)
    for name, sent in columns.items():
        got = batch[name]
        if isinstance(sent, torch.Tensor):
            assert isinstance(got, torch.Tensor) and not got.is_nested, name
            assert got.dtype == sent.dtype, name
            assert got.shape == sent.shape, name
            assert torch.equal(got, sent), name
        else:
            assert got == sent


def test_each_row_goes_once_to_a_task_and_to_every_task(bus: Bus, partition: str) -> None:
    _put_numbered(bus, partition, 6)
    first = bus.get(partition, ["idx"], task="reward", batch_size=4, timeout_s=10)
    second = bus.get(partition, ["idx"], task="reward", batch_size=2, timeout_s=10)
    taken = first["idx"].tolist() + second["idx"].tolist()
    assert sorted(taken) == list(range(6))
    with pytest.raises(BusTimeout):
        bus.get(partition, ["idx"], task="reward", batch_size=1, timeout_s=0.2)
    other = bus.get(partition, ["idx"], task="reference", batch_size=6, timeout_s=10)
    assert sorted(other["idx"].tolist()) == list(range(6))


def test_get_takes_exactly_batch_size_rows(bus: Bus, partition: str) -> None:
    _put_numbered(bus, partition, 5)
    batch = bus.get(partition, ["idx"], task="actor", batch_size=3, timeout_s=10)
    assert len(batch) == 3 and batch["idx"].shape == (3,)
    assert bus.counts(partition, task="actor", fields=["idx"]).ready == 2


def test_metadata_comes_back_with_its_own_row(bus: Bus, partition: str) -> None:
    meta = [
        RowMeta(
            policy_version=10 + i,
            sample_id=f"prompt{i // 2}-{i % 2}",
            trace={"traceparent": f"00-{i:032x}-{i:016x}-01"},
            extra={"group": i // 2},
        )
        for i in range(4)
    ]
    bus.put(partition, {"idx": torch.arange(4)}, meta)
    # Taken in two batches and from a plain-dict put too, so alignment is tested, not just order.
    bus.put(partition, {"idx": torch.tensor([4])}, [{"policy_version": 14, "sample_id": "prompt2-0"}])
    seen: dict[int, RowMeta] = {}
    for size in (3, 2):
        batch = bus.get(partition, ["idx"], task="actor", batch_size=size, timeout_s=10)
        for idx, row_meta in zip(batch["idx"].tolist(), batch.meta, strict=True):
            seen[idx] = row_meta
    for i in range(4):
        assert seen[i] == meta[i]
    assert seen[4] == RowMeta(policy_version=14, sample_id="prompt2-0")


def test_variable_length_rows_come_back_exact_and_pad_on_request(bus: Bus, partition: str) -> None:
    responses = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10, 11, 12, 13])]
    images = [torch.rand(3, 2, 4), torch.rand(3, 5, 1), torch.rand(3, 1, 1)]
    bus.put(partition, {"response_ids": responses, "image": images}, _meta(3))
    batch = bus.get(partition, ["response_ids", "image"], task="actor", batch_size=3, timeout_s=10)
    assert isinstance(batch["response_ids"], list)
    for got, sent in zip(batch["response_ids"], responses, strict=True):
        assert torch.equal(got, sent)
    for got, sent in zip(batch["image"], images, strict=True):
        assert torch.equal(got, sent)
    padded, lengths = batch.padded("response_ids", pad_value=0, side="right")
    assert padded.shape == (3, 5)
    assert torch.equal(lengths, torch.tensor([3, 1, 5]))
    assert torch.equal(padded[1], torch.tensor([8, 0, 0, 0, 0]))


def test_a_consumer_waiting_for_a_new_field_gets_it_once_written(bus: Bus, partition: str) -> None:
    _put_numbered(bus, partition, 4)
    waited: list[BusBatch | BaseException] = []

    def actor_waits() -> None:
        try:
            waited.append(bus.get(partition, ["idx", "rewards"], task="actor", batch_size=4, timeout_s=20))
        except BaseException as exc:  # surfaced by the assertion below
            waited.append(exc)

    waiter = threading.Thread(target=actor_waits)
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive() and not waited, "the actor task must wait until rewards exist"
    scored = bus.get(partition, ["idx"], task="reward", batch_size=4, timeout_s=10)
    bus.write_fields(scored, {"rewards": scored["idx"].float() * 0.5})
    waiter.join(timeout=20)
    assert len(waited) == 1 and isinstance(waited[0], BusBatch), waited
    batch = waited[0]
    assert torch.equal(batch["rewards"], batch["idx"].float() * 0.5)
    assert [m.sample_id for m in batch.meta] == [f"s{i}" for i in batch["idx"].tolist()]


def test_get_timeout_raises_promptly_with_counts(bus: Bus, partition: str) -> None:
    _put_numbered(bus, partition, 2)
    started = time.monotonic()
    with pytest.raises(BusTimeout) as caught:
        bus.get(partition, ["idx", "advantages"], task="actor", batch_size=5, timeout_s=0.5)
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 3.0
    err = caught.value
    assert (err.partition, err.task, err.wanted, err.ready, err.rows) == (partition, "actor", 5, 0, 2)
    assert err.missing_fields == ["advantages"]
    text = str(err)
    for needle in (partition, "'actor'", "['idx', 'advantages']", "only 0 were ready", "holds 2 rows"):
        assert needle in text, text


def test_timeout_reports_rows_that_are_ready_but_too_few(bus: Bus, partition: str) -> None:
    _put_numbered(bus, partition, 3)
    with pytest.raises(BusTimeout, match="only 3 were ready") as caught:
        bus.get(partition, ["idx"], task="actor", batch_size=4, timeout_s=0.2)
    assert caught.value.missing_fields == []
    # A timed-out get takes nothing: all three rows are still there for the task.
    assert len(bus.get(partition, ["idx"], task="actor", batch_size=3, timeout_s=10)) == 3


def test_counts_and_clear(bus: Bus, partition: str) -> None:
    _put_numbered(bus, partition, 5)
    bus.get(partition, ["idx"], task="reward", batch_size=2, timeout_s=10)
    counts = bus.counts(partition, task="reward", fields=["idx"])
    assert (counts.rows, counts.produced, counts.consumed, counts.ready) == (5, 5, 2, 3)
    assert bus.counts(partition, fields=["rewards"]).missing_fields == ("rewards",)
    assert partition in bus.partitions()
    bus.clear(partition)
    assert partition not in bus.partitions()
    assert bus.counts(partition, task="reward", fields=["idx"]).rows == 0
    with pytest.raises(BusTimeout):
        bus.get(partition, ["idx"], task="fresh", batch_size=1, timeout_s=0.2)


def test_bytes_moved_counts_tensor_payload_both_ways(bus: Bus, partition: str) -> None:
    before_put, before_got = bus.bytes_put, bus.bytes_got
    columns = {"x": torch.zeros(8, 16, dtype=torch.float32), "ids": [torch.zeros(3, dtype=torch.int64)] * 8}
    bus.put(partition, columns, _meta(8))
    assert bus.bytes_put - before_put == 8 * 16 * 4 + 8 * 3 * 8
    bus.get(partition, ["x"], task="actor", batch_size=8, timeout_s=10)
    assert bus.bytes_got - before_got == 8 * 16 * 4
    assert bus.bytes_moved == bus.bytes_put + bus.bytes_got


def test_put_rejects_bad_batches_before_touching_the_bus(bus: Bus, partition: str) -> None:
    with pytest.raises(BusError, match="has 3 rows but the batch has 2"):
        bus.put(partition, {"x": torch.zeros(3)}, _meta(2))
    with pytest.raises(BusError, match="policy_version"):
        bus.put(partition, {"x": torch.zeros(1)}, [{"sample_id": "a"}])
    assert partition not in bus.partitions()


def test_second_start_in_the_same_cluster_is_refused(bus: Bus) -> None:
    with pytest.raises(BusError, match="already running"):
        Bus.start()


@ray.remote(num_cpus=0)
class _Consumer:
    """A role-like actor in its own process that attaches to the driver's bus."""

    def __init__(self) -> None:
        self.bus = Bus.attach(timeout_s=30)

    def take_and_score(self, partition: str, n: int) -> tuple[list[int], list[str], list[int]]:
        batch = self.bus.get(partition, ["idx", "response_ids"], task="reward", batch_size=n, timeout_s=30)
        self.bus.write_fields(batch, {"rewards": batch["idx"].float() + 100})
        lengths = [len(r) for r in batch["response_ids"]]
        return batch["idx"].tolist(), [m.sample_id for m in batch.meta], lengths

    def close(self) -> None:
        self.bus.close()


def test_an_actor_in_another_process_attaches_reads_and_writes_back(bus: Bus, partition: str) -> None:
    n = 4
    responses = [torch.arange(i + 1) for i in range(n)]
    bus.put(partition, {"idx": torch.arange(n), "response_ids": responses}, _meta(n, prefix="remote"))
    consumer = _Consumer.remote()
    try:
        idx, sample_ids, lengths = ray.get(consumer.take_and_score.remote(partition, n), timeout=90)
        assert sorted(idx) == list(range(n))
        assert sample_ids == [f"remote{i}" for i in idx]
        assert lengths == [i + 1 for i in idx]
        ray.get(consumer.close.remote(), timeout=30)
    finally:
        ray.kill(consumer)
    # The rewards the other process wrote are visible here, and its close left the bus running.
    batch = bus.get(partition, ["idx", "rewards"], task="actor", batch_size=n, timeout_s=10)
    assert torch.equal(batch["rewards"], batch["idx"].float() + 100)


@ray.remote(num_cpus=0)
class _Producer:
    """A writer in its own process, killed after its put (as a failed rollout worker would be)."""

    def __init__(self) -> None:
        self.bus = Bus.attach(timeout_s=30)

    def put(self, partition: str, n: int, inline_bytes: int) -> None:
        from relax.bus import payloads

        payloads.INLINE_BYTES = inline_bytes
        self.bus.put(partition, {"idx": torch.arange(n), "text": [f"t{i}" for i in range(n)]}, _meta(n))


def test_rows_outlive_the_process_that_wrote_them(bus: Bus, partition: str, way: int) -> None:
    producer = _Producer.remote()
    ray.get(producer.put.remote(partition, 6, way), timeout=90)
    ray.kill(producer, no_restart=True)
    time.sleep(1.0)  # let Ray notice the dead worker (an object it owned would be lost now)
    batch = bus.get(partition, ["idx", "text"], task="actor", batch_size=6, timeout_s=10)
    assert batch["idx"].tolist() == list(range(6)) and batch["text"] == [f"t{i}" for i in range(6)]


def test_clearing_a_partition_releases_its_payloads(bus: Bus, partition: str, way: int) -> None:
    from relax.bus.payloads import find_keeper

    keeper = find_keeper()
    bus.put(partition, {"x": torch.zeros(4, 2)}, _meta(4))
    batch = bus.get(partition, ["x"], task="reward", batch_size=4, timeout_s=10)
    bus.write_fields(batch, {"rewards": torch.ones(4)})
    assert ray.get(keeper.held.remote())[partition] == 2  # the put and the reward write
    bus.clear(partition)
    assert partition not in ray.get(keeper.held.remote())
    assert partition not in bus.partitions()


def test_clearing_several_partitions_soon_releases_each_and_leaves_the_others(bus: Bus, way: int) -> None:
    from relax.bus.payloads import find_keeper

    keeper = find_keeper()
    done, kept = [f"soon-{uuid.uuid4().hex[:8]}" for _ in range(2)], f"kept-{uuid.uuid4().hex[:8]}"
    for name in (*done, kept):
        bus.put(name, {"x": torch.zeros(3, 2)}, _meta(3))
    bus.clear_soon(done)
    deadline = time.monotonic() + 10
    while any(name in ray.get(keeper.held.remote()) for name in done) and time.monotonic() < deadline:
        time.sleep(0.02)
    held, partitions = ray.get(keeper.held.remote()), bus.partitions()
    assert not any(name in held or name in partitions for name in done)
    assert held[kept] == 1 and kept in partitions
    assert bus.get(kept, ["x"], task="actor", batch_size=3, timeout_s=10)["x"].shape == (3, 2)
    bus.clear(kept)


def test_rows_from_several_puts_come_back_in_the_readers_order(bus: Bus, partition: str, way: int) -> None:
    """A reader may take rows of several puts at once, and a later write of a field wins."""
    bus.put(partition, {"idx": torch.arange(3), "w": torch.zeros(3, 2, dtype=torch.bfloat16),
                        "ids": [torch.arange(i + 1) for i in range(3)]}, _meta(3, prefix="a"))
    bus.put(partition, {"idx": torch.arange(3, 5), "w": torch.ones(2, 2, dtype=torch.bfloat16),
                        "ids": [torch.arange(7), torch.arange(2)]}, _meta(2, prefix="b"))
    first = bus.get(partition, ["idx"], task="reward", batch_size=2, timeout_s=10)
    bus.write_fields(first, {"w": torch.full((2, 2), 5.0, dtype=torch.bfloat16)})
    batch = bus.get(partition, ["idx", "w", "ids"], task="actor", batch_size=5, timeout_s=10)
    idx = batch["idx"].tolist()
    assert sorted(idx) == list(range(5)) and batch["w"].dtype == torch.bfloat16
    rewritten = set(first["idx"].tolist())
    for row, i in enumerate(idx):
        expected = 5.0 if i in rewritten else (0.0 if i < 3 else 1.0)
        assert batch["w"][row].tolist() == [expected, expected]
        assert batch["ids"][row].tolist() == ([*range(i + 1)] if i < 3 else [*range(7 if i == 3 else 2)])
        assert batch.meta[row].sample_id == (f"a{i}" if i < 3 else f"b{i - 3}")


def test_small_payloads_go_by_value_and_large_ones_by_reference_and_read_together(
        bus: Bus, partition: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A put at most ``INLINE_BYTES`` is kept in the keeper's memory, a larger one in the object
    store; one read may take rows of both."""
    from relax.bus import payloads

    monkeypatch.setattr(payloads, "INLINE_BYTES", 1024)
    bus.put(partition, {"idx": torch.arange(4), "x": torch.zeros(4, 8)}, _meta(4, prefix="small"))  # 160 bytes
    bus.put(partition, {"idx": torch.arange(4, 8), "x": torch.ones(4, 512)}, _meta(4, prefix="large"))  # 8 KB
    batch = bus.get(partition, ["idx", "x"], task="actor", batch_size=8, timeout_s=10)
    assert sorted(batch["idx"].tolist()) == list(range(8))
    for row, i in enumerate(batch["idx"].tolist()):
        assert batch["x"][row].tolist() == ([0.0] * 8 if i < 4 else [1.0] * 512)
    found, _ = ray.get(payloads.find_keeper().locate.remote(partition, batch.handle.batch_meta.global_indexes, ["x"]))
    assert sorted(type(p).__name__ for p in found) == ["ObjectRef", "dict"]


def test_the_bus_field_name_is_reserved(bus: Bus, partition: str) -> None:
    with pytest.raises(BusError, match="bus's own field"):
        bus.put(partition, {"__row_meta__": torch.zeros(1)}, _meta(1))


def test_the_controller_process_imports_transferqueue_without_torch_dynamo(bus: Bus) -> None:
    """TransferQueue's controller runs from ``relax.bus.controller``, so its process skips
    tensordict's ``torch._dynamo`` import (about a second of CPU on every run's start-up)."""
    from relax.bus import deployment

    controller = deployment.find_controller()
    assert controller is not None
    loaded = ray.get(controller.__ray_call__.remote(
        lambda _: sorted(m for m in __import__("sys").modules if m in ("relax.bus.controller", "torch._dynamo"))))
    assert loaded == ["relax.bus.controller"]

