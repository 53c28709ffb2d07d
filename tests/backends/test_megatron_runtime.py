"""``relax run`` with a Megatron actor over two ranks: real Ray (fake GPUs), the real bus, gloo.

The actor's two ranks are two Ray actors on their planned bundles, joined in one process group by
the runtime (``relax.runtime.worker.ranks``); Megatron splits the model over them by tensor or pipeline
parallelism. On-policy with the same seeds, the first step trains the same samples from the same
weights as a one-rank actor, so its loss and gradient norm must agree.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from relax import testing
from relax.runtime.driver.launch import WORKER_SETUP_ENV
from tests.backends.megatron_cpu import WORKER_SETUP

pytestmark = [pytest.mark.megatron, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ROOT = Path(__file__).resolve().parents[2]
#: Separate mode, on-policy, a rollout on one fake GPU; tiny-lm with two kv heads (tp=2 splits them).
COMMON = ("placement.mode=separate", "async_policy.max_staleness=0", "roles.rollout.gpus_per_replica=1",
          "cluster.address=auto", "trainer.steps=3", "trainer.checkpoint_every=3", "roles.actor.backend=megatron",
          "model.options.num_kv_heads=2")
LAYOUTS = {"tp2": ("roles.actor.parallel.tp=2",), "pp2": ("roles.actor.parallel.pp=2",), "dp2": ()}


@pytest.fixture(scope="module")
def fake_gpus():
    """A local Ray with 3 fake GPUs whose workers install the CPU stand-ins for megatron-core."""
    env = {WORKER_SETUP_ENV: WORKER_SETUP,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with testing.local_ray(num_gpus=3, runtime_env={"worker_process_setup_hook": WORKER_SETUP, "env_vars": env}):
        yield


@pytest.fixture(scope="module")
def one_rank(fake_gpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("one-rank")
    return testing.tiny_run(root, "one", *COMMON, "roles.actor.gpus=1", "cluster.gpus_per_node=2")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_megatron_actor_over_two_ranks_trains_like_one(one_rank, tmp_path, layout) -> None:
    code, rows, printed = testing.tiny_run(tmp_path, layout, *COMMON, "roles.actor.gpus=2", "cluster.gpus_per_node=3",
                                           *LAYOUTS[layout])
    assert code == 0, printed
    one = one_rank[1]
    assert one_rank[0] == 0, one_rank[2]
    assert [r["step"] for r in rows] == [r["step"] for r in one] == [1, 2, 3]
    first, reference = rows[0], one[0]
    assert first["samples/trained_hash"] == reference["samples/trained_hash"]
    print(f"{layout}: loss {first['train/loss']:.6g} vs {reference['train/loss']:.6g}, grad_norm "
          f"{first['train/grad_norm']:.6g} vs {reference['train/grad_norm']:.6g}")
    for key in ("train/loss", "train/grad_norm"):
        assert first[key] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), key
    assert first["train/tokens"] == reference["train/tokens"]
    assert (tmp_path / layout / "checkpoints" / "step-3" / "trainer" / "model.safetensors").is_file()


def test_the_tiny_moe_trains_with_r3_on_a_megatron_actor(fake_gpus, tmp_path) -> None:
    """The tiny Qwen3-MoE with rollout routing replay: the hf rollout's routed experts reach the
    Megatron actor over the bus, which replays them in every step (``router_replay/changed``
    measured) and, on-policy with the same routing, reports a near-zero mismatch."""
    code, rows, printed = testing.tiny_run(tmp_path, "r3", *COMMON, "roles.actor.gpus=1", "cluster.gpus_per_node=2",
                                           "model.options.architecture=qwen3_moe", "algorithm.router_replay=r3")
    assert code == 0, printed
    assert [r["step"] for r in rows] == [1, 2, 3]
    print("mismatch/kl", [r["mismatch/kl"] for r in rows], "changed", [r["train/router_replay/changed"] for r in rows])
    for row in rows:
        assert row["train/tokens"] > 0 and math.isfinite(row["train/loss"])
        assert 0.0 <= row["train/router_replay/changed"] < 0.5
        assert row["mismatch/tokens"] > 0  # on-policy: every row is of the actor's version
        assert 0.0 <= row["mismatch/kl"] < 1e-6 and row["mismatch/max_abs"] < 1e-3
