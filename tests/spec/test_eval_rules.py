"""``data.eval`` with ``trainer.eval_every``: accepted on the tiny preset, refused (with the field and
what to do) where the evaluation has no prompts or cannot score in the rollout worker. The plan
gives the evaluation a worker of its own outside colocate mode (``trainer.eval.host: auto``; on GPUs
only when the roles leave it a rollout engine's GPUs), or hands the held-out data set to the first
rollout replica only, with rewards of its own when no reward loop rides in it."""

from __future__ import annotations


import pytest

from relax.config import load_spec_dict
from relax.plan import make_plan
from relax.spec import SpecError, validate_spec
from relax.config.loader import PRESETS_DIR as PRESETS

EVAL = "data.eval={source: 'synthetic:arithmetic', options: {size: 16, seed: 1}}"


def _spec(*overrides: str):
    raw, _ = load_spec_dict(str(PRESETS / "tiny-cpu.yaml"), list(overrides))
    return validate_spec(raw)


def _issues(*overrides: str) -> dict[str, str]:
    try:
        _spec(*overrides)
    except SpecError as exc:
        return {i.path: f"{i.message} | {i.remedy}" for i in exc.issues}
    return {}


def test_held_out_prompts_with_an_interval_validate():
    assert _issues(EVAL, "trainer.eval_every=10", "trainer.eval.samples_per_prompt=8") == {}


@pytest.mark.parametrize("overrides, path, words", [
    (["trainer.eval_every=10"], "trainer.eval_every", "data.eval is not set"),
    ([EVAL, "roles.reward.host=own"], "data.eval", "roles.reward.host is own"),
    ([EVAL, "trainer.eval.samples_per_prompt=0"], "trainer.eval.samples_per_prompt", "greater than or equal to 1"),
    ([EVAL, "trainer.eval.host=own", "placement.mode=colocate", "async_policy.max_staleness=0"], "trainer.eval.host",
     "not supported in colocate mode"),
    ([EVAL, "trainer.eval.host=elsewhere"], "trainer.eval.host", "use one of: auto, own, rollout"),
])
def test_an_evaluation_that_cannot_run_is_refused(overrides, path, words):
    issues = _issues(*overrides)
    assert path in issues and words in issues[path], issues


def test_outside_colocate_mode_the_plan_gives_the_evaluation_a_worker_of_its_own():
    plan = make_plan(_spec(EVAL, "trainer.eval_every=5"), base_dir=PRESETS)
    assert [(p.name, [b.cpus for b in p.bundles]) for p in plan.pools if p.name == "evaluation"] == [("evaluation", [1.0])]
    [worker] = [w for w in plan.workers if w.holder == "evaluation"]
    [loop] = worker.roles
    # a rollout engine (a rollout's fault policy) that only evaluates, with rewards it builds itself
    assert (loop.role, loop.task, loop.weights_in) == ("rollout", "evaluation", "object-store")
    assert [p.name for p in loop.plugins] == ["hf"] and loop.evaluation.name == "synthetic:arithmetic"
    assert [r.plugin.name for r in loop.evaluation_rewards] == ["exact_match"] and not loop.reads and not loop.writes
    [rollout] = [r for w in plan.workers for r in w.roles if r.task == "rollout"]
    assert rollout.evaluation is None  # the step loop's rollout does not evaluate
    assert ("actor", "evaluation", "object-store") in [(e.source, e.target, e.mechanism) for e in plan.weight_sync]
    assert {i.what for m in plan.memory for i in m.items if i.role == "evaluation"} == {"weights", "kv_cache", "logits"}
    # colocate mode: the rollout evaluates between steps
    colocated = make_plan(_spec(EVAL, "placement.mode=colocate", "async_policy.max_staleness=0"), base_dir=PRESETS)
    assert "evaluation" not in [p.name for p in colocated.pools]
    assert [r.evaluation is not None for w in colocated.workers for r in w.roles if r.task == "rollout"] == [True]


GPUS = ("cluster.gpus_per_node=4", "roles.rollout.gpus_per_replica=1")


def test_on_gpus_the_evaluation_worker_takes_a_free_rollout_engine_or_the_rollout_evaluates():
    plan = make_plan(_spec(EVAL, *GPUS, "roles.actor.gpus=2"), base_dir=PRESETS)
    [engine] = plan.instances_of("evaluation")
    taken = {(i.node, g) for i in plan.instances if i.role != "evaluation" for g in i.gpus}
    assert len(engine.gpus) == 1 and (engine.node, engine.gpus[0]) not in taken
    assert plan.gpus_used == 4
    full = make_plan(_spec(EVAL, *GPUS, "roles.actor.gpus=3"), base_dir=PRESETS)  # auto: no GPU left
    assert full.instances_of("evaluation") == []
    assert [r.evaluation is not None for w in full.workers for r in w.roles if r.task == "rollout"] == [True]
    with pytest.raises(SpecError) as refused:
        make_plan(_spec(EVAL, *GPUS, "roles.actor.gpus=3", "trainer.eval.host=own"), base_dir=PRESETS)
    [issue] = refused.value.issues
    assert issue.path == "trainer.eval.host" and "needs 1 free GPUs" in issue.message
    assert "trainer.eval.host: rollout" in issue.remedy


def test_with_host_rollout_the_plan_gives_the_held_out_set_to_the_step_loop_rollout_only():
    spec = _spec(EVAL, "trainer.eval_every=5", "trainer.eval.max_prompts=8", "trainer.eval.host=rollout")
    plan = make_plan(spec, base_dir=PRESETS)
    assert plan.settings.eval_every == 5 and plan.settings.evaluation.max_prompts == 8
    [rollout] = [w for worker in plan.workers for w in worker.roles if w.role == "rollout"]
    assert rollout.evaluation.name == "synthetic:arithmetic" and rollout.evaluation.options["seed"] == 1
    assert rollout.evaluation_rewards == []  # the reward loop rides in that worker: it scores
    assert plan.instances_of("evaluation") == []
    two = make_plan(_spec(EVAL, "roles.rollout.replicas=2", "trainer.eval.host=rollout"), base_dir=PRESETS)
    wirings = [w for worker in two.workers for w in worker.roles if w.role == "rollout"]
    assert [w.evaluation is not None for w in wirings] == [True, False]
    assert [r.plugin.name for r in wirings[0].evaluation_rewards] == ["exact_match"]
    assert make_plan(_spec(), base_dir=PRESETS).settings.evaluation is None
