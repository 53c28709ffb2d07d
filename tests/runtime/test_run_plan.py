"""A run executes its plan: ``relax run`` writes the plan it builds its workers from (``plan.json``),
which is what ``relax plan --format json`` prints for the same spec and overrides, and every worker
the controller started is a planned one, on its planned bundle (``workers.json``, written from what
each worker reports of itself). ``spec.yaml`` is the resolved spec, and validates to the same spec.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax import testing
from relax.cli import main
from relax.config import load_spec_dict
from relax.spec import validate_spec


@pytest.fixture(scope="module")
def local_ray():
    with testing.local_ray():
        yield


def overrides_for(out: Path) -> list[str]:
    """A hybrid PPO run: a critic, a reference in the actor's worker, the advantage beside the
    actor, a scorer riding on the rollout: four workers of different shapes."""
    return [f"name=planned", f"trainer.output_dir={out}", "trainer.steps=2", "tracing.exporter=none",
            "placement.mode=hybrid", "async_policy.max_staleness=1", "algorithm.name=ppo", "algorithm.kl_coef=0.01",
            "roles.reference={backend: torch, gpus: 0}", "roles.critic={backend: torch, gpus: 0}"]


def test_the_run_writes_the_plan_it_executes_and_starts_exactly_its_workers(local_ray, tmp_path: Path,
                                                                         capsys) -> None:
    out = tmp_path / "planned"
    overrides = overrides_for(out)
    assert main(["run", "tiny-cpu", *overrides]) == 0
    ran = capsys.readouterr().out
    # the start-up before the first step, phase by phase, printed and kept
    startup = json.loads((out / "startup.json").read_text())
    assert list(startup["phases_s"]) == ["imports", "model", "ray", "launch", "first_step"]
    assert all(v >= 0 for v in startup["phases_s"].values())
    assert startup["total_s"] == pytest.approx(sum(startup["phases_s"].values()))
    # what ran inside the phases, at once: the runtime imports beside Ray, the bus beside the workers
    parts = startup["parts"]
    assert set(parts) == {"runtime_imports", "bus", "placement", "workers"}
    assert all(0 <= p["start_s"] <= p["end_s"] <= startup["total_s"] for p in parts.values())
    assert parts["bus"]["start_s"] < parts["workers"]["end_s"] and parts["workers"]["start_s"] < parts["bus"]["end_s"]
    assert startup["shutdown_s"] >= 0
    assert f"start-up: {startup['total_s']:.1f} s to the first step" in ran and "[bus " in ran and " alongside " in ran
    assert main(["plan", "tiny-cpu", *overrides, "--format", "json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((out / "plan.json").read_text())
    assert written == printed

    planned = {w["holder"]: w for w in written["workers"]}
    started = json.loads((out / "workers.json").read_text())
    assert sorted(w["holder"] for w in started) == sorted(planned)
    assert len(planned) == 4  # rollout/reward, advantage, actor/reference, critic
    for worker in started:
        plan = planned[worker["holder"]]
        assert worker["roles"] == list(dict.fromkeys(loop["role"] for loop in plan["roles"]))
        assert (worker["pool"], worker["bundle"], worker["node"]) == (
            plan["instance"]["pool"], plan["instance"]["bundles"][0], plan["instance"]["node"])
        # what the worker reports of itself: it runs in its pool's placement group
        assert worker["placement_group_pool"] == plan["instance"]["pool"]
        assert not worker["moved"]

    # spec.yaml is the spec with every default and override resolved
    raw, base = load_spec_dict("tiny-cpu", overrides)
    again, _ = load_spec_dict(str(out / "spec.yaml"), [])
    assert validate_spec(again, base_dir=out) == validate_spec(raw, base_dir=base)
