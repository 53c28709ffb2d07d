"""Model roles across several processes: real Ray actors per rank, a real gloo group, fake GPUs.

Two data-parallel ranks of the torch trainer must give the update of one process on the same
batch, and a ``relax run`` whose actor has two GPUs (two ranks) must train the same first step as
one whose actor has one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from relax import testing
from relax.runtime.model_files import materialize_model
from relax.runtime.worker.components import build_trainer
from relax.plan.wiring import loss_use, trainer_use
from relax.runtime.worker.ranks import RankedTrainer
from relax.runtime.worker_launch import RankPlacement

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

UPDATES = 2  # two optimizer updates per step: each rank's k-th mini-batch must be part of the k-th whole one


@pytest.fixture(scope="module")
def fake_gpus():
    with testing.local_ray(num_gpus=3):
        yield


def spec_and_model(tmp_path: Path, *overrides: str):
    # SGD: the update is proportional to the gradient, so the ranks' float round-off (each packs its
    # own rows) stays round-off; Adam's first step is sign(gradient), which round-off can flip.
    spec, _, base = testing.tiny_spec(tmp_path, "ranks", f"algorithm.updates_per_step={UPDATES}",
                                      "roles.actor.optimizer.name=sgd", "roles.actor.optimizer.lr=0.5", *overrides)
    return spec, materialize_model(spec, base)


@ray.remote(num_cpus=0, num_gpus=1)
class Leader:
    """Rank 0 in a process of its own (a process group must not outlive a test in pytest's)."""

    def __init__(self, spec, model_path: str, world: int) -> None:
        ranks = [RankPlacement(r, {"tp": 0, "cp": 0, "dp": r, "pp": 0},
                               {} if r == 0 else {"num_cpus": 0, "num_gpus": 1}) for r in range(world)]
        self.trainer = RankedTrainer(trainer_use(spec, "actor", 1), loss_use(spec), "actor", model_path, 1, ranks,
                                     timeout_s=120)

    def probe(self, batch):
        import torch.distributed as dist

        logprobs = self.trainer.compute_logprobs(batch)
        metrics = self.trainer.train_step(batch)
        return {"logprobs": logprobs, "metrics": metrics, "weights": self.trainer.weights(),
                "world": dist.get_world_size(), "backend": dist.get_backend(),
                "ranks_on_gpus": [info["gpus"] for info in self.trainer.placed]}

    def save(self, path: str) -> None:
        self.trainer.save(path)


def test_two_data_parallel_ranks_update_like_one_process(fake_gpus, tmp_path: Path) -> None:
    spec, model_path = spec_and_model(tmp_path)
    batch = testing.sample_train_batch(rows=12)
    leader = Leader.remote(spec, model_path, 2)
    two = ray.get(leader.probe.remote(batch), timeout=300)
    assert two["world"] == 2 and two["backend"] == "gloo"
    assert len(two["ranks_on_gpus"]) == 1 and len(two["ranks_on_gpus"][0]) == 1  # the follower got its own GPU id

    torch.set_num_threads(1)
    one = build_trainer(spec, model_path, 1)
    logprobs = one.compute_logprobs(batch)
    metrics = one.train_step(batch)
    weights = one.weights()

    # Response tokens only: a prompt's first token gets no log-prob when its shard trims the column before it.
    mask = batch.response_mask.bool()
    assert mask.sum() == batch.num_response_tokens
    assert torch.allclose(two["logprobs"][mask], logprobs[mask], atol=1e-6), (two["logprobs"] - logprobs)[mask].abs().max()
    assert metrics["updates"] == two["metrics"]["updates"] == UPDATES
    for key in ("loss", "grad_norm"):
        assert two["metrics"][key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key
    assert two["metrics"]["tokens"] == metrics["tokens"] == batch.num_response_tokens
    worst = max((two["weights"][k] - v).abs().max().item() for k, v in weights.items())
    assert worst < 1e-6, worst
    assert any((weights[k] - v).abs().max() > 0 for k, v in build_trainer(spec, model_path, 1).weights().items())

    # A checkpoint is written once, by rank 0, and loads into one process.
    ray.get(leader.save.remote(str(tmp_path / "ckpt")), timeout=120)
    fresh = build_trainer(spec, model_path, 1)
    fresh.load(str(tmp_path / "ckpt"))
    assert fresh.version == 1
    assert max((fresh.weights()[k] - v).abs().max().item() for k, v in two["weights"].items()) == 0.0
    ray.kill(leader)


def test_a_batch_smaller_than_the_data_parallel_size_is_refused(fake_gpus, tmp_path: Path) -> None:
    spec, model_path = spec_and_model(tmp_path)
    leader = Leader.remote(spec, model_path, 2)
    with pytest.raises(ray.exceptions.RayTaskError, match="1 rows cannot be split over 2 data-parallel ranks"):
        ray.get(leader.probe.remote(testing.sample_train_batch(rows=1)), timeout=300)
    ray.kill(leader)


ACTOR_ON = {1: ("roles.actor.gpus=1", "cluster.gpus_per_node=2"), 2: ("roles.actor.gpus=2", "cluster.gpus_per_node=3")}


def test_a_run_whose_actor_spans_two_ranks_trains_like_one(fake_gpus, tmp_path: Path) -> None:
    common = ("placement.mode=separate", "async_policy.max_staleness=0", "roles.rollout.gpus_per_replica=1",
              "cluster.address=auto", "trainer.steps=3")
    runs = {ranks: testing.tiny_run(tmp_path, f"actor-{ranks}", *common, *ACTOR_ON[ranks]) for ranks in (1, 2)}
    for ranks, (code, rows, printed) in runs.items():
        assert code == 0, printed
        assert [r["step"] for r in rows] == [1, 2, 3]
    one, two = runs[1][1], runs[2][1]
    # On-policy, same seeds: step 0 trains the same samples from the same weights.
    assert two[0]["samples/trained_hash"] == one[0]["samples/trained_hash"]
    for key in ("train/loss", "train/grad_norm"):
        assert two[0][key] == pytest.approx(one[0][key], rel=1e-4, abs=1e-6), key
    assert two[0]["train/tokens"] == one[0]["train/tokens"]
    assert (tmp_path / "actor-2" / "checkpoints" / "step-3" / "trainer" / "model.safetensors").is_file()
