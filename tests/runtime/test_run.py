"""``relax run`` of the tiny preset on a real local Ray with the real TransferQueue bus."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax import testing
from relax.runtime.driver.launch import run_spec

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def local_ray():
    """One Ray for the module (each run still starts and closes its own bus and workers)."""
    with testing.local_ray():
        yield


tiny = testing.tiny_spec
run = testing.tiny_run


MODES = [("colocate", 0), ("separate", 0), ("separate", 1), ("separate", 2), ("hybrid", 1),
         # reward workers of their own, reading responses from the bus (the default scores in the rollout)
         ("separate", 3, "roles.reward.host=own")]


@pytest.fixture(scope="module")
def mode_runs(local_ray, tmp_path_factory) -> dict[tuple[str, int], tuple[int, list[dict], str]]:
    """Each placement mode and staleness bound, 4 steps each, run once for the tests below."""
    root = tmp_path_factory.mktemp("modes")
    runs = {(mode, k): run(root, f"{mode}-{k}", f"placement.mode={mode}", f"async_policy.max_staleness={k}",
                           "trainer.steps=4", "tracing.exporter=jsonl", *host)
            for mode, k, *host in MODES}
    return {key: (*result, root / f"{key[0]}-{key[1]}") for key, result in runs.items()}


@pytest.mark.parametrize(("mode", "k"), [m[:2] for m in MODES])
def test_each_mode_trains_within_its_staleness_bound(mode_runs, mode: str, k: int) -> None:
    code, rows, printed, _ = mode_runs[(mode, k)]
    assert code == 0
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert max(r["staleness/max"] for r in rows) <= k
    for key in ("reward/mean", "staleness/mean", "time/step_s", "time/rollout_s", "time/train_s",
                "time/wait_s", "time/weight_sync_s", "throughput/tokens_per_s"):
        assert all(key in r for r in rows), key
    assert all(r["throughput/tokens_per_s"] > 0 for r in rows)
    assert printed.count("[relax] step") == 4  # plain progress lines when not a terminal


def test_async_modes_use_their_slack(mode_runs) -> None:
    # With k >= 1 the rollout may run ahead: some step trains on samples one version old.
    for key in (("separate", 1), ("separate", 2), ("hybrid", 1), ("separate", 3)):
        assert max(r["staleness/max"] for r in mode_runs[key][1]) >= 1, key


def test_separate_on_policy_matches_colocate_step_by_step(mode_runs) -> None:
    """Colocated, the rollout generates with the actor's own model (no weight copies); apart, it
    loads each version from the object store: the same samples and updates either way."""
    colocate, separate = mode_runs[("colocate", 0)][1], mode_runs[("separate", 0)][1]
    workers = {mode: json.loads((mode_runs[(mode, 0)][3] / "workers.json").read_text())
               for mode in ("colocate", "separate")}
    assert [w["shares_policy_model"] for w in workers["colocate"]] == [True]
    assert not any(w["shares_policy_model"] for w in workers["separate"])
    assert [r["data/order"] for r in colocate] == [r["data/order"] for r in separate]
    assert [r["reward/mean"] for r in colocate] == [r["reward/mean"] for r in separate]
    for a, b in zip(colocate, separate):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-6)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)


def test_resume_continues_with_the_same_data_order_and_step_count(local_ray, tmp_path: Path) -> None:
    whole = run(tmp_path, "whole", "placement.mode=colocate", "async_policy.max_staleness=0",
                "trainer.steps=4", "trainer.checkpoint_every=2")
    assert whole[0] == 0
    first = run(tmp_path, "split", "placement.mode=colocate", "async_policy.max_staleness=0",
                "trainer.steps=2", "trainer.checkpoint_every=2")
    assert first[0] == 0 and len(first[1]) == 2
    resumed = run(tmp_path, "split", "placement.mode=colocate", "async_policy.max_staleness=0",
                  "trainer.steps=4", "trainer.checkpoint_every=2", resume=True)
    assert resumed[0] == 0
    assert [r["step"] for r in resumed[1]] == [1, 2, 3, 4]
    assert [r["data/order"] for r in resumed[1]] == [r["data/order"] for r in whole[1]]
    for a, b in zip(resumed[1], whole[1]):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-6)
    assert sorted(p.name for p in (tmp_path / "split" / "checkpoints").iterdir()) == ["step-2", "step-4"]


def test_a_role_failure_stops_the_run_with_its_cause(local_ray, tmp_path: Path, capsys) -> None:
    # Validation reads the first rows of a data file (their columns are right); the first step
    # reads past them, into rows without a prompt.
    from relax.spec.rules import DATA_ROWS_CHECKED

    data = tmp_path / "bad.jsonl"
    rows = [{"prompt": "1+1=", "answer": "2"}] * DATA_ROWS_CHECKED + [{"question": "1+1=", "answer": "2"}] * 4
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    code, rows, _ = run(tmp_path, "broken", f"data.train={{source: {data}}}", "data.shuffle=false",
                        f"algorithm.prompts_per_step={DATA_ROWS_CHECKED + 4}")
    assert code == 1 and rows == []
    err = capsys.readouterr().err
    assert "rollout failed at step 0" in err and "no 'prompt' column" in err


def test_gpu_specs_stop_before_anything_starts(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a machine without GPUs
    spec, plan, base = tiny(tmp_path, "gpu", preset="qwen3-4b-grpo-async")
    assert run_spec(spec, plan, base_dir=base) == 1
    err = capsys.readouterr().err
    assert "cannot run here" in err and "cluster.address: the spec asks for 8 GPUs on this machine" in err
    assert "which has 0" in err
    assert not (tmp_path / "gpu").exists()  # stopped before creating anything


def test_resume_needs_a_checkpoint(tmp_path: Path, capsys) -> None:
    spec, plan, base = tiny(tmp_path, "empty")
    assert run_spec(spec, plan, base_dir=base, resume=True) == 1
    assert "no checkpoint" in capsys.readouterr().err


def test_a_fresh_run_keeps_the_earlier_run_in_its_folder(tmp_path: Path) -> None:
    from relax.runtime.driver.launch import RUN_MARKER, keep_previous_run

    folder = tmp_path / "run"
    assert keep_previous_run(folder) is None
    (folder / "checkpoints" / "step-2").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("{}\n")
    (folder / RUN_MARKER).write_text("{}\n")  # what every run writes first
    assert keep_previous_run(folder) == tmp_path / "run.1" and not folder.exists()
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("{}\n")
    (folder / RUN_MARKER).write_text("{}\n")
    assert keep_previous_run(folder) == tmp_path / "run.2"
    assert (tmp_path / "run.1" / "checkpoints" / "step-2").is_dir()


def test_the_tiny_preset_learns_the_task(local_ray, tmp_path: Path) -> None:
    # The README's main job, shortened: separate mode, max_staleness 1, as the preset says.
    code, rows, _ = run(tmp_path, "learns", "trainer.steps=30")
    assert code == 0
    rewards = [r["reward/mean"] for r in rows]
    assert sum(rewards[:3]) / 3 <= 0.4, rewards[:3]
    assert sum(rewards[-5:]) / 5 >= 0.8, rewards[-5:]


def test_one_trace_follows_every_step_and_links_train_steps_to_their_rollouts(mode_runs) -> None:
    from relax.telemetry import read_spans

    spans = read_spans(mode_runs[("separate", 1)][3] / "traces.jsonl")
    assert len({s["trace_id"] for s in spans}) == 1
    by_id = {s["span_id"]: s for s in spans}
    roots = [s for s in spans if s["name"] == "relax.run"]
    steps = {s["attributes"]["relax.step"]: s for s in spans if s["name"] == "relax.step"}
    assert len(roots) == 1 and sorted(steps) == [0, 1, 2, 3]
    assert all(s["parent_id"] == roots[0]["span_id"] for s in steps.values())
    work = [s for s in spans if s["name"] in ("relax.rollout.batch", "relax.reward.score",
                                              "relax.advantage.compute", "relax.actor.train_step")]
    assert len(work) == 16
    for span in work:  # every role's unit of work sits under the step it worked on
        assert by_id[span["parent_id"]] is steps[span["attributes"]["relax.step"]]
    rollouts = {s["span_id"]: s for s in spans if s["name"] == "relax.rollout.batch"}
    trains = {s["attributes"]["relax.step"]: s for s in spans if s["name"] == "relax.actor.train_step"}
    for t, span in trains.items():  # each step trains the batch made for it...
        assert [rollouts[link["span_id"]]["attributes"]["relax.step"] for link in span["links"]] == [t]
    assert max(s["attributes"]["relax.staleness"] for s in trains.values()) == 1  # ...by an older policy,
    # generated while the previous step trained: the link reaches back into the previous step.
    linked_start = {t: rollouts[s["links"][0]["span_id"]]["start"] for t, s in trains.items()}
    assert any(linked_start[t] < trains[t - 1]["end"] for t in range(1, 4))


@pytest.mark.parametrize(("key", "overlaps"), [(("colocate", 0), False), (("separate", 1), True)])
def test_relax_trace_shows_overlap_only_when_roles_run_apart(mode_runs, key, overlaps: bool) -> None:
    from relax.telemetry.analysis import load_spans, summarize_traces

    summary = summarize_traces(load_spans(mode_runs[key][3]))[0]
    assert (summary.overlap_s > 0) is overlaps
