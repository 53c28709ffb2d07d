"""The weight group's transport over gloo: a sender and receivers in separate processes."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from relax.weight_group import WeightGroupError, WeightRecipient, WeightSender, plan_buckets

TIMEOUT_S = 60.0


def state_dict(round_: int) -> dict[str, torch.Tensor]:
    """Mixed dtypes and shapes (a scalar, an empty tensor, a non-contiguous one), different per round."""
    g = torch.Generator().manual_seed(round_)
    return {
        "embed.weight": torch.randn(64, 48, generator=g),
        "layer.0.weight": torch.randn(48, 48, generator=g).to(torch.bfloat16),
        "layer.0.bias": torch.randn(48, generator=g).to(torch.float16),
        "layer.0.scale": torch.tensor(float(round_), dtype=torch.float64),
        "steps": torch.arange(round_, round_ + 7, dtype=torch.int64),
        "mask": torch.rand(5, 3, generator=g) > 0.5,
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(8, 6, generator=g).t(),
    }


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def receive_rounds(address: dict, rank: int, rounds: int, out: mp.Queue) -> None:
    recipient = WeightRecipient(address, rank, who=f"test receiver {rank}")
    try:
        for _ in range(rounds):
            version, tensors = recipient.receive()
            # Raw bytes: a tensor put on a queue would be shared memory gone with this process.
            out.put((rank, version, {name: (str(t.dtype), list(t.shape), as_bytes(t)) for name, t in tensors}))
    finally:
        recipient.close()


def exchange(receivers: int, rounds: int, bucket_bytes: int) -> list[tuple[int, int, dict]]:
    ctx = mp.get_context("spawn")
    sender = WeightSender(receivers, timeout_s=TIMEOUT_S, bucket_bytes=bucket_bytes, host="127.0.0.1")
    out = ctx.Queue()
    procs = [ctx.Process(target=receive_rounds, args=(sender.address.as_dict(), r, rounds, out))
             for r in range(1, receivers + 1)]
    for p in procs:
        p.start()
    try:
        stats = [sender.send(state_dict(n), version=10 + n) for n in range(rounds)]
        got = [out.get(timeout=TIMEOUT_S) for _ in range(receivers * rounds)]
    finally:
        for p in procs:
            p.join(timeout=TIMEOUT_S)
        sender.close()
    assert all(p.exitcode == 0 for p in procs)
    assert all(s["bytes"] > 0 for s in stats)
    return got


def assert_bit_exact(got: dict[str, tuple], sent: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(sent)
    for name, tensor in sent.items():
        assert got[name] == (str(tensor.dtype), list(tensor.shape), as_bytes(tensor)), name


def test_two_receivers_get_several_rounds_of_mixed_dtypes_bit_exactly() -> None:
    got = exchange(receivers=2, rounds=3, bucket_bytes=1 << 20)
    for rank in (1, 2):
        mine = sorted((version, tensors) for r, version, tensors in got if r == rank)
        assert [version for version, _ in mine] == [10, 11, 12]
        for n, (_, tensors) in enumerate(mine):
            assert_bit_exact(tensors, state_dict(n))


def test_a_bucket_smaller_than_one_tensor_still_carries_it_whole() -> None:
    sizes = {name: t.numel() * t.element_size() for name, t in state_dict(0).items()}
    assert max(sizes.values()) > 1000
    buckets = plan_buckets([(k, v.dtype, list(v.shape)) for k, v in state_dict(0).items()], bucket_bytes=1000)
    assert any(b["nbytes"] > 1000 and len(b["tensors"]) == 1 for b in buckets)
    assert all(len({b["dtype"]}) == 1 for b in buckets)
    (_, version, tensors), = exchange(receivers=1, rounds=1, bucket_bytes=1000)
    assert version == 10
    assert_bit_exact(tensors, state_dict(0))


def test_a_receiver_that_never_joins_is_named_in_the_sender_s_error() -> None:
    ctx = mp.get_context("spawn")
    sender = WeightSender(2, timeout_s=3.0, host="127.0.0.1")
    out = ctx.Queue()
    proc = ctx.Process(target=receive_rounds, args=(sender.address.as_dict(), 1, 1, out))
    proc.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not sender.store.check(["joined/1"]) and time.monotonic() < deadline:  # rank 1 is up
        time.sleep(0.1)
    started = time.monotonic()
    try:
        with pytest.raises(WeightGroupError, match=r"receiver rank\(s\) \[2\] of 2 did not join within 3 s") as err:
            sender.send(state_dict(0), version=1)
        assert "test receiver 1" in str(err.value)  # who did join is listed
        assert time.monotonic() - started < 30
    finally:
        proc.kill()
        proc.join()
        sender.close()


def test_a_receiver_without_a_sender_says_where_it_looked() -> None:
    sender = WeightSender(1, timeout_s=2.0, host="127.0.0.1")
    address = {**sender.address.as_dict(), "timeout_s": 2.0}
    recipient = WeightRecipient(address, 1)
    with pytest.raises(WeightGroupError, match="did not form within|did not start within"):
        recipient.receive()  # the sender never sends: no backend announced, no round
    recipient.close()
    sender.close()


def listeners() -> set[tuple[str, int]]:
    import psutil

    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


def test_the_store_listens_on_the_sender_s_address_alone() -> None:
    """A store made by host and port listens on every interface; the sender's listens on its host
    (loopback here, as in an embedded run), and receivers still reach it."""
    before = listeners()
    sender = WeightSender(1, timeout_s=TIMEOUT_S, host="127.0.0.1")
    try:
        opened = listeners() - before
        assert opened == {("127.0.0.1", sender.address.port)}
        recipient = WeightRecipient(sender.address, 1)
        recipient.store.set("probe", b"1")
        assert sender.store.get("probe") == b"1"
    finally:
        sender.close()
