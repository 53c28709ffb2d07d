"""What ``relax run`` prints about itself, without starting a run: the progress and its time left
(on a fake clock), the banner of a plan and the closing summary of a run folder."""

from __future__ import annotations

import io
import json

import pytest

from relax.config import load_spec_dict
from relax.plan import make_plan
from relax.runtime.metrics import Progress, StepPace, format_duration
from relax.runtime.driver.run_text import banner, model_phase, summary, worker_lines
from relax.spec import validate_spec


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def row(step: int, step_s: float = 2.0, reward: float = 0.5, **extra) -> dict:
    return {"step": step, "reward/mean": reward, "staleness/max": 1, "throughput/tokens_per_s": 40.0,
            "time/step_s": step_s, "time/rollout_s": 1.0, "time/train_s": 0.5, "time/weight_sync_s": 0.01,
            "time/wait_s": 0.0, **extra}


def spec_and_plan(preset: str, *overrides: str):
    raw, base = load_spec_dict(preset, list(overrides))
    spec = validate_spec(raw, base_dir=base)
    return spec, make_plan(spec, base_dir=base)


def test_durations_read_as_a_person_reads_them():
    assert [format_duration(s) for s in (0.4, 42, 185, 7620)] == ["0 s", "42 s", "3 min 05 s", "2 h 07 min"]


def test_the_time_left_is_the_pace_of_the_steps_finished_here():
    clock = FakeClock()
    pace = StepPace(total=10, clock=clock)
    assert pace.update(1, step_s=9.0) == pytest.approx(9 * 9.0)  # one step: its own time, start-up aside
    clock.now += 4.0
    assert pace.update(2, step_s=4.0) == pytest.approx(8 * 4.0)
    clock.now += 2.0
    assert pace.update(3, step_s=2.0) == pytest.approx(7 * 3.0)  # (4 + 2) s over 2 steps
    clock.now += 3.0
    assert pace.update(10, step_s=3.0) == 0.0


def test_a_resumed_run_counts_its_pace_from_its_own_first_step():
    clock = FakeClock()
    pace = StepPace(total=100, clock=clock)
    pace.update(41, step_s=5.0)
    clock.now += 10.0
    assert pace.update(43, step_s=5.0) == pytest.approx(57 * 5.0)


def test_plain_lines_with_the_time_left_when_not_a_terminal():
    clock, out = FakeClock(), io.StringIO()
    progress = Progress(4, out, clock=clock)
    for step in range(1, 5):
        progress.update(row(step))
        clock.now += 30.0
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and all(line.startswith(f"[relax] step {n}/4  reward 0.500") for n, line in enumerate(lines, 1))
    assert lines[0].endswith("ETA 6 s") and lines[1].endswith("ETA 1 min 00 s") and lines[3].endswith("done")
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_a_terminal_gets_a_live_bar_that_ends_with_the_run():
    clock, out = FakeClock(), Terminal()
    progress = Progress(3, out, clock=clock)
    progress.update(row(1))
    assert progress._bar is not None
    clock.now += 10.0
    progress.update(row(2))
    clock.now += 10.0
    progress.update(row(3))
    assert progress._bar is None  # the last step stopped it
    text = out.getvalue()
    assert "3/3" in text and "reward 0.500" in text and "ETA 10 s" in text and "done" in text
    progress.close()  # idempotent


def test_a_mismatch_alarm_is_its_own_line():
    from relax.spec.models import MismatchSpec

    out = io.StringIO()
    progress = Progress(2, out, MismatchSpec(kl_alarm=0.1), clock=FakeClock())
    progress.update(row(1, **{"mismatch/kl": 0.5, "mismatch/tokens": 10, "mismatch/max_abs": 1.0}))
    assert out.getvalue().splitlines()[1].startswith("[relax] step 1: MISMATCH ALARM: mismatch/kl 0.5")


def test_the_banner_names_the_run_its_folder_mode_and_where_each_role_runs(tmp_path):
    spec, plan = spec_and_plan("qwen3-4b-grpo-async")
    text = banner(spec, plan, tmp_path / "out")
    lines = text.splitlines()
    assert lines[0] == "relax run: qwen3-4b-grpo-async: grpo, separate mode, 500 steps, 8 GPUs on 1 node"
    assert lines[1] == f"  output   {tmp_path / 'out'}" and lines[2] == "  model    Qwen/Qwen3-4B"
    assert lines[3:] == ["  worker   rollout/reward/advantage on node 0, 1 GPU",
                         "  worker   actor on node 0, 4 GPUs",  # one worker drives the 4 actor ranks
                         "  worker   rollout x3 on node 0, 1 GPU each"]
    assert "steps 11..500 (resumed)" in banner(spec, plan, tmp_path, start_step=10)
    assert model_phase(spec) is None  # a hub model: the workers load it


def test_a_cpu_run_with_a_reference_shows_it_and_its_model_build():
    spec, plan = spec_and_plan("tiny-cpu", "roles.reference={backend: torch, gpus: 0}", "algorithm.kl_coef=0.01")
    assert worker_lines(plan) == ["rollout/reward/advantage on node 0, CPU", "actor on node 0, CPU",
                                  "reference on node 0, CPU"]
    assert model_phase(spec) == "relax run: building the model builtin:tiny-lm (cached after the first run)..."


def test_the_summary_says_what_ran_and_where_its_files_are(tmp_path):
    spec, _ = spec_and_plan("tiny-cpu", f"trainer.output_dir={tmp_path}")
    for step in (2, 4):
        folder = tmp_path / "checkpoints" / f"step-{step}"
        folder.mkdir(parents=True)
        (folder / "meta.json").write_text(json.dumps({"step": step}))
    (tmp_path / "traces.jsonl").write_text("")
    rows = [row(1, reward=0.125), row(2), row(3), row(4, reward=0.75)]
    lines = summary(spec, tmp_path, rows, 125.0).splitlines()
    assert lines[0] == "relax run: done: 4 steps in 2 min 05 s; reward 0.125 -> 0.750"
    assert lines[1] == f"  checkpoints  {tmp_path / 'checkpoints' / 'step-4'} (newest of 2; resume with --resume)"
    assert f"  report       relax report {tmp_path}   (reward and step time as a PNG)" in lines
    assert f"  traces       {tmp_path / 'traces.jsonl'}   (relax trace {tmp_path})" in lines
    assert not any("export" in line for line in lines)  # no trainer.export_every


def test_the_summary_names_the_newest_export_when_the_run_exports(tmp_path):
    from types import SimpleNamespace

    spec, _ = spec_and_plan("tiny-cpu")
    for step in (2, 10):
        (tmp_path / "export" / f"step-{step}").mkdir(parents=True)
    exporting = SimpleNamespace(trainer=SimpleNamespace(export_every=2))  # trainer.export_every, once it exists
    text = summary(exporting, tmp_path, [row(1)], 3.0)
    assert f"  export       {tmp_path / 'export' / 'step-10'}" in text
    assert "export" not in summary(spec, tmp_path, [row(1)], 3.0)


@pytest.fixture(scope="module")
def local_ray():
    from relax import testing

    with testing.local_ray():
        yield


def test_a_real_run_explains_itself_and_its_trace_has_every_role(local_ray, tmp_path, capsys):
    """One tiny PPO-style run with a reference: the banner, the model phase, progress lines with
    the time left, the start-up line and the closing summary, in that order; then ``relax trace``
    of it numbers steps as metrics.jsonl does and lists the reference."""
    from relax.cli import main
    from relax.testing import tiny_run

    code, rows, printed = tiny_run(tmp_path, "told", "tracing.exporter=jsonl", "algorithm.kl_coef=0.01",
                                   "roles.reference={backend: torch, gpus: 0}")
    assert code == 0 and [r["step"] for r in rows] == [1, 2, 3]
    out = tmp_path / "told"
    lines = printed.splitlines()
    assert lines[:3] == ["relax run: told: grpo, separate mode, 3 steps, CPU", f"  output   {out}",
                         "  model    builtin:tiny-lm"]
    assert "  worker   reference on node 0, CPU" in lines
    building = lines.index("relax run: building the model builtin:tiny-lm (cached after the first run)...")
    assert lines[building + 1].startswith("relax run: the model is ready (")
    progress = [line for line in lines if line.startswith("[relax] step ")]
    assert [p.split()[2] for p in progress] == ["1/3", "2/3", "3/3"]
    assert " ETA " in progress[0] and progress[-1].endswith("done")
    startup = next(i for i, line in enumerate(lines) if line.startswith("relax run: start-up: "))
    done = lines[startup + 1]
    assert done.startswith("relax run: done: 3 steps in ") and startup > lines.index(progress[-1])
    assert done.endswith(f"reward {rows[0]['reward/mean']:.3f} -> {rows[-1]['reward/mean']:.3f}")
    assert f"  checkpoints  {out / 'checkpoints' / 'step-3'} (newest of 1; resume with --resume)" in lines
    assert lines[-1] == f"  traces       {out / 'traces.jsonl'}   (relax trace {out})"

    capsys.readouterr()
    assert main(["trace", str(out)]) == 0
    trace = capsys.readouterr().out
    assert "steps 3 (1..3)" in trace and "before the first step's work (not counted as idle)" in trace
    roles = {line.split()[0] for line in trace.splitlines()[3:] if line.startswith("  ") and not line.startswith("  rollout ")}
    assert {"reference", "actor", "reward", "advantage"} <= roles


def test_the_banner_of_a_separate_cpu_run_on_too_few_cores_points_to_colocate(tmp_path, monkeypatch):
    from relax.plan import wiring

    monkeypatch.setattr(wiring, "available_cores", lambda: 2)
    spec, plan = spec_and_plan("tiny-cpu")
    note = banner(spec, plan, tmp_path).splitlines()[-1]
    assert note.startswith("  note     2 model processes share this machine's 2 cores")
    assert note.endswith("run it with placement.mode=colocate async_policy.max_staleness=0")
    assert plan.cores_note is not None and plan.cores_note.text in plan.notes
    assert plan.cores_note.fix == ["placement.mode=colocate", "async_policy.max_staleness=0"]
    monkeypatch.setattr(wiring, "available_cores", lambda: 8)
    spec, plan = spec_and_plan("tiny-cpu")  # planned on a machine of 8 cores
    assert plan.cores_note is None and "note" not in banner(spec, plan, tmp_path)
