"""The Python API: ``relax.validate``, ``relax.plan`` and ``relax.run`` return what the commands of
the same names work with, and ``import relax`` alone loads none of it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import relax
from relax.cli import main
from relax.plan import make_plan, render
from relax.spec import SpecError
from relax.spec.models import RunSpec

from .conftest import ROOT

HEAVY_OR_API = ("torch", "ray", "pydantic", "relax.api", "relax.spec", "relax.plan")


def test_import_relax_loads_nothing_until_used():
    probe = ("import json, sys, relax\n"
             f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({HEAVY_OR_API!r}))))\n"
             "relax.plan('tiny-cpu')\n"
             "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ray'})))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    before, after = (json.loads(line) for line in result.stdout.splitlines())
    assert before == [] and after == [], result.stderr


def test_validate_returns_the_spec_the_command_checks():
    spec = relax.validate("tiny-cpu", ["trainer.steps=5"])
    assert isinstance(spec, RunSpec) and spec.trainer.steps == 5 and spec.name == "tiny-cpu"
    assert relax.validate(spec) == spec  # a RunSpec is checked again as it is
    mapping = spec.model_dump(mode="json")
    assert relax.validate(mapping) == spec


def test_validate_raises_every_problem_as_the_command_prints_them(capsys):
    bad = ["trainer.steps=0", "algorithm.samples_per_prompt=-1"]
    with pytest.raises(SpecError) as caught:
        relax.validate("tiny-cpu", bad)
    assert main(["validate", "tiny-cpu", *bad]) == 2
    # The command prints each fix as the command line to rerun, the error as overrides (str(issue)).
    assert capsys.readouterr().err.strip() == caught.value.render(["relax", "validate", "tiny-cpu", *bad]).strip()
    assert len(caught.value.issues) == 2
    assert [issue.fix for issue in caught.value.issues] == [("algorithm.samples_per_prompt=1",), ("trainer.steps=1",)]


def test_plan_is_the_plan_the_command_renders(capsys):
    plan = relax.plan("tiny-cpu", ["placement.mode=hybrid"])
    assert main(["plan", "tiny-cpu", "placement.mode=hybrid"]) == 0
    assert render(plan, "table") == capsys.readouterr().out
    assert plan == make_plan(relax.validate("tiny-cpu", ["placement.mode=hybrid"]))
    from relax import plan as plan_package  # the package of the same name answers the call too

    assert plan_package("tiny-cpu") == relax.plan("tiny-cpu") and plan_package.make_plan is make_plan


def test_validate_judges_the_spec_and_here_judges_this_machine_too(monkeypatch):
    from relax.spec import machine
    from relax.spec.validate import machine_notes

    monkeypatch.setattr(machine, "local_gpu_count", lambda: 0)
    spec = relax.validate("qwen3-4b-grpo-async")  # 8 GPUs on an embedded Ray: a valid spec
    assert "cluster.address" in [note.path for note in machine_notes(spec)]
    with pytest.raises(SpecError) as caught:
        relax.validate("qwen3-4b-grpo-async", here=True)  # as relax validate --here and relax run
    assert "cluster.address" in [issue.path for issue in caught.value.issues]


@pytest.mark.parametrize(("args", "error", "match"), [
    (("tiny-cpu", "trainer.steps=2"), TypeError, "list of dotted overrides"),
    (({"name": "x"}, ["trainer.steps=2"]), ValueError, "change the mapping itself"),
    ((42,), TypeError, "not int"),
])
def test_misused_arguments_say_what_to_pass(args, error, match):
    with pytest.raises(error, match=match):
        relax.validate(*args)


def test_run_trains_and_returns_its_code_folder_and_metrics(tmp_path):
    import io

    from relax import testing

    out, printed = tmp_path / "api", io.StringIO()
    with testing.local_ray():
        result = relax.run("tiny-cpu", [f"trainer.output_dir={out}", "trainer.steps=2", "tracing.exporter=none",
                                        "data.eval={source: 'synthetic:arithmetic', options: {size: 4, seed: 3}}"],
                           stream=printed)
    assert result.ok and result.code == 0 and result.output_dir == out
    assert [row["step"] for row in result.metrics] == [1, 2]
    assert [e["eval/version"] for e in result.evals] == [2]  # data.eval without eval_every: the final version
    assert "relax run: done: 2 steps in " in printed.getvalue()
