"""Starting, attaching and stopping the bus: refusals with remedies, and no hangs.

The first tests stub Ray's answers (they check the guards, not Ray); the last one runs a real
Ray and TransferQueue, since what it checks is how TransferQueue behaves once stopped.
"""

from __future__ import annotations

import time

import pytest
import ray
import torch

from relax.bus import Bus, BusError, RowMeta
from relax.bus import deployment


def test_start_without_ray_says_to_init_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deployment.ray, "is_initialized", lambda: False)
    with pytest.raises(BusError, match=r"ray.init\(num_cpus=8\)"):
        Bus.start()


def test_start_refuses_instead_of_hanging_when_ray_lacks_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deployment.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(deployment, "find_controller", lambda: None)
    monkeypatch.setattr(deployment.ray, "available_resources", lambda: {"CPU": 0.5})
    with pytest.raises(BusError, match="needs 1 free logical CPU .* only 0.5 are free"):
        Bus.start()


def test_attach_without_a_running_bus_fails_after_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deployment, "find_controller", lambda: None)
    started = time.monotonic()
    with pytest.raises(BusError, match=r"Bus.start\(\) first"):
        Bus.attach(timeout_s=0.3)
    assert time.monotonic() - started < 2.0


def test_attached_handle_fails_fast_after_the_owner_stops() -> None:
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    owner: Bus | None = None
    try:
        owner = Bus.start()
        attached = Bus.attach(timeout_s=10)
        assert owner.is_owner and not attached.is_owner
        owner.put("step-0", {"x": torch.ones(2, 3)}, [RowMeta(0, "a"), RowMeta(0, "b")])
        batch = attached.get("step-0", ["x"], task="t", batch_size=2, timeout_s=10)
        assert torch.equal(batch["x"], torch.ones(2, 3))

        owner.close()
        owner.close()  # idempotent
        started = time.monotonic()
        with pytest.raises(BusError, match="did not answer"):
            attached.get("step-0", ["x"], task="t", batch_size=1, timeout_s=0.5)
        assert time.monotonic() - started < 15.0
        attached.close()
        with pytest.raises(BusError, match="closed"):
            attached.counts("step-0")
    finally:
        if owner is not None:
            owner.close()
        if started_ray:
            ray.shutdown()
