"""``data.eval`` with ``trainer.eval_every``: accepted on the tiny preset, refused (with the field and
what to do) where the evaluation has no prompts or cannot score in the rollout worker; the plan
hands the held-out data set to the first rollout replica only, with rewards of its own when no
reward loop rides in it."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax.config import load_spec_dict
from relax.plan import make_plan
from relax.spec import SpecError, validate_spec

PRESETS = Path(__file__).resolve().parents[2] / "presets"
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
])
def test_an_evaluation_that_cannot_run_is_refused(overrides, path, words):
    issues = _issues(*overrides)
    assert path in issues and words in issues[path], issues


def test_the_plan_gives_the_held_out_set_to_the_step_loop_rollout_only():
    spec = _spec(EVAL, "trainer.eval_every=5", "trainer.eval.max_prompts=8")
    plan = make_plan(spec, base_dir=PRESETS)
    assert plan.settings.eval_every == 5 and plan.settings.evaluation.max_prompts == 8
    [rollout] = [w for worker in plan.workers for w in worker.roles if w.role == "rollout"]
    assert rollout.evaluation.name == "synthetic:arithmetic" and rollout.evaluation.options["seed"] == 1
    assert rollout.evaluation_rewards == []  # the reward loop rides in that worker: it scores
    two = make_plan(_spec(EVAL, "roles.rollout.replicas=2"), base_dir=PRESETS)
    wirings = [w for worker in two.workers for w in worker.roles if w.role == "rollout"]
    assert [w.evaluation is not None for w in wirings] == [True, False]
    assert [r.plugin.name for r in wirings[0].evaluation_rewards] == ["exact_match"]
    assert make_plan(_spec(), base_dir=PRESETS).settings.evaluation is None
