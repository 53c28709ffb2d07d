"""Colocation across ranks (a hybrid engine): a rollout engine in every rank's process of a 2-rank
FSDP2 actor on CPU (real Ray actors, a real gloo group), seen from rank 0 as one rollout.

The mechanism, in the default suite: each rank's engine generates a share of the prompts, and after
a train step each rank hands its own engine the weights gathered from its shards, in its own
process: the engines then hold the trainer's weights exactly, and the hand-over creates no object
in Ray's object store (the store's own cumulative counter), where passing the weights through an
actor call does. The learning run of ``tiny-fsdp-cpu`` is in the ``fsdp`` lane.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
import torch

from relax import testing
from relax.plan.wiring import loss_use, rollout_use, trainer_use
from relax.runtime.model_files import materialize_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PROMPTS = ["1 + 2 =", "3 + 4 =", "5 + 1 =", "2 + 2 =", "7 + 1 ="]


@pytest.fixture(scope="module")
def local_ray():
    with testing.local_ray():
        yield


def object_store_created_bytes() -> int:
    """Bytes ever created in this node's object store (the raylet's cumulative counter)."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
    return int(reply.store_stats.cumulative_created_bytes)


@ray.remote(num_cpus=0)
class Leader:
    """Rank 0 in a process of its own (a process group must not outlive a test in pytest's): the
    actor's ranks, rank 0's rollout engine and the engines of the other ranks."""

    def __init__(self, spec, base: Path, model_path: str) -> None:
        from relax.runtime.worker.ranks import RankedTrainer, RankEngines, build_rank_engine
        from relax.runtime.worker_launch import RankPlacement

        torch.set_num_threads(1)
        ranks = [RankPlacement(r, {"tp": 0, "cp": 0, "dp": r, "pp": 0}, {} if r == 0 else {"num_cpus": 0})
                 for r in range(2)]
        self.trainer = RankedTrainer(trainer_use(spec, "actor", 1), loss_use(spec), "actor", model_path, 1, ranks,
                                     timeout_s=120)
        engine = rollout_use(spec, 1, base)
        self.engines = RankEngines(self.trainer, build_rank_engine(engine, model_path), engine, model_path)
        self.sampling = spec.roles.rollout.sampling

    def placed(self) -> list[dict]:
        return self.engines.placed

    def generate(self, seed: int) -> list[tuple[int, list[int], list[float]]]:
        gens = self.engines.generate(PROMPTS, 2, self.sampling, seed)
        return [(g.prompt_index, list(g.response_ids), [float(x) for x in g.logprobs]) for g in gens]

    def each_rank_alone(self, seed: int) -> list[list[tuple[list[int], list[float]]]]:
        """The same prompts, seed and sampling on each rank's engine by itself."""
        local = self.engines.local.generate(PROMPTS, 1, self.sampling, seed)
        other = ray.get(self.trainer.followers[0].generate.remote(PROMPTS, 1, self.sampling, seed, {}))
        return [[(list(g.response_ids), [float(x) for x in g.logprobs]) for g in gens] for gens in (local, other)]

    def train_and_hand_over(self, batch) -> dict:
        self.engines.sleep()
        self.trainer.train_step(batch)
        before = object_store_created_bytes()
        handed = self.engines.hand_over(1)
        created = object_store_created_bytes() - before
        full = self.trainer.weights()  # the trainer's full weights, gathered from the shards
        held = self.engines.local.model.state_dict()
        worst = max((held[name] - tensor).abs().max().item() for name, tensor in full.items())
        before = object_store_created_bytes()
        self.trainer.load_weights(full, 1)  # the same weights through an actor call, for comparison
        through_calls = object_store_created_bytes() - before
        model_bytes = sum(t.numel() * t.element_size() for t in full.values())
        return {"handed": handed, "created": created, "through_calls": through_calls, "model_bytes": model_bytes,
                "worst": worst, "versions": self.engines.local.version}


def test_each_rank_hosts_an_engine_that_takes_its_weights_in_process(local_ray, tmp_path: Path) -> None:
    spec, _, base = testing.tiny_spec(tmp_path, "hybrid", preset="tiny-fsdp-cpu")
    leader = Leader.remote(spec, base, materialize_model(spec, base))
    placed = ray.get(leader.placed.remote(), timeout=300)
    assert [e["rank"] for e in placed] == [0, 1] and len({e["pid"] for e in placed}) == 2
    assert {e["backend"] for e in placed} == {"hf"}

    # One generate call: every prompt's samples, in prompt order, from both ranks' shares.
    gens = ray.get(leader.generate.remote(5), timeout=120)
    assert [g[0] for g in gens] == [i for i in range(len(PROMPTS)) for _ in range(2)]
    assert all(len(g[1]) == len(g[2]) > 0 for g in gens)

    # Before any hand-over both engines hold the starting weights: the same draw on each is the same.
    rank0, rank1 = ray.get(leader.each_rank_alone.remote(11), timeout=120)
    assert rank0 == rank1

    out = ray.get(leader.train_and_hand_over.remote(testing.sample_train_batch(rows=8)), timeout=300)
    assert out["versions"] == 1
    assert out["worst"] == 0.0  # rank 0's engine holds exactly the trainer's full weights
    assert out["handed"] == out["model_bytes"]
    # The hand-over put nothing in the object store; the same weights through an actor call do.
    assert out["through_calls"] >= out["model_bytes"]
    assert out["created"] < out["model_bytes"] // 100, out

    # And rank 1's engine took the same new weights in its own process: the same draws as rank 0's,
    # which differ from the starting weights' draws.
    after0, after1 = ray.get(leader.each_rank_alone.remote(11), timeout=120)
    assert after0 == after1
    assert [lp for _, lp in after0] != [lp for _, lp in rank0]
    ray.kill(leader)


def test_validate_and_plan_show_both_ranks_with_their_engines(capsys) -> None:
    from relax.cli import main

    assert main(["validate", "tiny-fsdp-cpu"]) == 0
    assert main(["plan", "tiny-fsdp-cpu"]) == 0
    printed = capsys.readouterr().out
    assert "actor ranks 2, a rollout engine in each (rank 0 cpu[0], rank 1 cpu[1])" in printed
    assert "actor[0..1], rollout[0..1]" in printed
    assert main(["plan", "tiny-fsdp-cpu", "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    workers = plan["workers"]
    assert len(workers) == 1 and workers[0]["engine_per_rank"] and workers[0]["ranks"] == {"actor": [0, 1]}
    assert sorted(i["bundles"][0] for i in plan["instances"] if i["role"] == "rollout") == [0, 1]


@pytest.mark.fsdp
def test_the_tiny_fsdp_preset_learns_like_tiny_cpu(local_ray, tmp_path: Path) -> None:
    """``relax run tiny-fsdp-cpu``: 2 CPU ranks under FSDP2, each hosting its rollout engine,
    learn the task as the 1-rank run does (reward <= 0.4 -> >= 0.8), and ``workers.json`` shows both
    ranks and their engines."""
    code, rows, printed = testing.tiny_run(tmp_path, "learns", "trainer.steps=30", preset="tiny-fsdp-cpu")
    assert code == 0, printed
    rewards = [r["reward/mean"] for r in rows]
    assert sum(rewards[:3]) / 3 <= 0.4, rewards[:3]
    assert sum(rewards[-5:]) / 5 >= 0.8, rewards[-5:]
    assert all(r["weights/sync_bytes"] > 0 for r in rows)
    (worker,) = json.loads((tmp_path / "learns" / "workers.json").read_text())
    assert [r["rank"] for r in worker["ranks"]["actor"]] == [1]
    engines = worker["rollout_engines"]
    assert [(e["rank"], e["backend"]) for e in engines] == [(0, "hf"), (1, "hf")]
    assert engines[0]["pid"] == worker["pid"] and engines[1]["pid"] == worker["ranks"]["actor"][0]["pid"]
