"""Weights through the object store travel as one buffer (``PackedWeights``): every tensor comes
back bit for bit, with its dtype and shape, writable and independent of the sender's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray
import torch

from relax.runtime.worker.weight_channels import ObjectStoreWeights, PackedWeights, unpacked


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(7, 5, generator=g),  # 140 bytes: the next offset needs padding
        "norm.weight": torch.randn(3, generator=g).to(torch.bfloat16),
        "step": torch.tensor(11, dtype=torch.int64),  # 0-d
        "mask": torch.tensor([True, False, True]),
        "half.weight": torch.randn(2, 3, generator=g).to(torch.float16).t(),  # not contiguous
        "empty": torch.empty(0, 4),
    }


def test_a_state_dict_round_trips_bit_for_bit_through_one_buffer() -> None:
    state = _state()
    packed = PackedWeights.of(state)
    assert isinstance(packed, PackedWeights) and packed.buffer.ndim == 1
    back = packed.unpack()
    assert list(back) == list(state)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert torch.equal(back[name], tensor), name


def test_unpacked_tensors_are_writable_copies() -> None:
    state = _state()
    packed = PackedWeights.of(state)
    back = packed.unpack()
    back["embed.weight"].add_(1.0)
    assert torch.equal(packed.unpack()["embed.weight"], state["embed.weight"])
    state["norm.weight"].zero_()  # the sender's later changes do not reach what was packed
    assert not torch.equal(packed.unpack()["norm.weight"], state["norm.weight"])


def test_a_dict_with_other_values_travels_as_it_is() -> None:
    weights = {"w": torch.ones(2), "_extra_state": {"scale": 2}}
    assert PackedWeights.of(weights) is weights
    assert unpacked(weights) is weights


@pytest.fixture(scope="module")
def local_ray():
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def test_packed_weights_survive_the_object_store(local_ray) -> None:
    state = _state()
    back = unpacked(ray.get(ray.put(PackedWeights.of(state))))
    assert all(torch.equal(back[k], v) for k, v in state.items())
    back["mask"][0] = False  # writable, though the store's buffer is read-only


def test_versions_published_in_the_background_reach_run_state_in_order(local_ray) -> None:
    """The actor's side publishes in a background thread: every version lands, in order, the newest
    last, and ``settle`` returns once it has."""
    from relax.runtime.state.run_state import RunState

    from relax.runtime.state.ledger import RolloutLedger
    from relax.runtime.state.records import StepReport

    ledger = RolloutLedger(steps=6, prompts_per_step=2, samples_per_prompt=2, unit_prompts=2)
    state = ray.remote(RunState).options(num_cpus=0, max_concurrency=8).remote(ledger)
    # the worker's step reports waiting to ride (RoleEnv.carried_reports): those of step v - 2
    carried = {v: [StepReport(v - 2, "actor", {"v": v})] for v in range(3, 6)}
    version = 0
    env = SimpleNamespace(state=state, timeout_s=30.0, take_carried_reports=lambda: carried.pop(version, None))
    channel = ObjectStoreWeights(env)
    seen = []
    for version in range(1, 6):
        channel.publish(version, {"w": torch.full((3,), float(version))})
        seen.append(ray.get(state.wait_version.remote(0, 30.0)).version)
    channel.settle()
    assert seen == sorted(seen)  # never backwards
    newest = ray.get(state.wait_version.remote(5, 30.0))
    assert newest.version == 5
    assert torch.equal(unpacked(ray.get(newest.weights[0]))["w"], torch.full((3,), 5.0))
    got = ray.get(state.wait_reports.remote(1, ["actor"], 30.0))  # the reports rode on the publishes
    assert [r["actor"]["v"] for r in got.reports] == [3, 4, 5]
    ray.kill(state)


def test_a_failed_background_publish_is_raised_by_the_next_one() -> None:
    class Broken:
        def __getattr__(self, name):
            raise ConnectionError("RunState is gone")

    channel = ObjectStoreWeights(SimpleNamespace(state=Broken(), timeout_s=5.0, take_carried_reports=lambda: None))
    channel.publish(1, {"w": torch.ones(2)})  # returns at once: the failure is in the background
    with pytest.raises(ConnectionError, match="RunState is gone"):
        channel.publish(2, {"w": torch.ones(2)})
    channel.settle()  # the error was raised once, by the publish that found it
