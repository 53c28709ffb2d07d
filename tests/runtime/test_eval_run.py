"""``relax run`` with held-out evaluation (``data.eval``, ``trainer.eval_every``) on a real local
Ray and the real TransferQueue bus, in separate and colocate mode: every due policy version is
evaluated once, with one version per evaluation (the same version gives the same figures in both
modes: same weights, same evaluation seed), the figures reach metrics.jsonl, eval.jsonl, the trace,
the closing summary and ``relax report``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax import testing

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

EVAL = ("data.eval={source: 'synthetic:arithmetic', options: {size: 12, seed: 1}}", "trainer.eval_every=4",
        "trainer.steps=8", "tracing.exporter=jsonl")


@pytest.fixture(scope="module")
def local_ray():
    with testing.local_ray():
        yield


def _evals(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]


def test_separate_and_colocate_runs_evaluate_each_due_version_once(local_ray, tmp_path: Path, capsys) -> None:
    code, rows, printed = testing.tiny_run(tmp_path, "separate", *EVAL)
    assert code == 0, printed[-3000:]
    evals = _evals(tmp_path / "separate")
    versions = [e["eval/version"] for e in evals]
    # before training, the first version held at or after 4, and the final one
    assert versions[0] == 0 and 4 <= versions[1] < 8 and versions[-1] == 8 and len(versions) == 3, versions
    for e in evals:
        assert e["eval/prompts"] == 12 and e["eval/samples"] == 48  # 4 samples per prompt by default
        assert e["eval/pass@1"] <= e["eval/pass@2"] <= e["eval/pass@4"]
        assert e["eval/pass@1"] == pytest.approx(e["eval/reward_mean"])  # exact_match scores 0 or 1
        row = rows[e["step"] - 1]  # each evaluation went into the metrics row it names (the newest stays)
        assert row["step"] == e["step"] and row["eval/version"] >= e["eval/version"]
    assert rows[-1]["eval/version"] == 8  # the last row waited for the final evaluation
    assert [r["step"] for r in rows] == list(range(1, 9))
    spans = [json.loads(line) for line in (tmp_path / "separate" / "traces.jsonl").read_text().splitlines()]
    evaluated = sorted(s["attributes"]["relax.policy_version"] for s in spans if s["name"] == "relax.evaluate")
    assert evaluated == versions
    assert "evaluation" in printed and "v0 -> v8" in printed
    # trainer.eval.host auto, separate mode: a worker of its own evaluated, not the rollout
    workers = json.loads((tmp_path / "separate" / "workers.json").read_text())
    assert [(w["holder"], w["pool"]) for w in workers if w["holder"] == "evaluation"] == [("evaluation", "evaluation")]

    code, _, printed = testing.tiny_run(tmp_path, "colocate", *EVAL, "placement.mode=colocate",
                                        "async_policy.max_staleness=0")
    assert code == 0, printed[-3000:]
    colocated = _evals(tmp_path / "colocate")
    assert [e["eval/version"] for e in colocated] == [0, 4, 8]  # on-policy: the multiples themselves
    same = {k: v for k, v in colocated[0].items() if k not in ("step", "eval/seconds")}
    assert same == {k: v for k, v in evals[0].items() if k not in ("step", "eval/seconds")}

    from relax.cli import main

    capsys.readouterr()
    assert main(["report", str(tmp_path / "colocate")]) == 0
    out = capsys.readouterr().out
    assert "held-out evaluation" in out and out.count("\n") >= 5 and "pass@4" in out
