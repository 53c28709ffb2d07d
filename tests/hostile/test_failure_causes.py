"""A cause on every failure: the hostile-input catalogue of runs that fail, and how they end.

Each row of ``TABLE`` is a probe: what is broken, the exit code of the run, and the words its LAST
line must hold (the exception type and message; the file and line for data). A failure that would
repeat on any retry (a worker that cannot start, a reward that breaks its contract or fails under
its policy) must stop the run at once: no "restarted in place" line, no restart budget spent.

| probe                  | broken                                             | exit | last line holds                                   |
|------------------------|----------------------------------------------------|------|---------------------------------------------------|
| malformed_jsonl        | line 26 of the data file is not JSON (validation reads 20) | 1 | DatasetFileError, bad.jsonl:26, invalid JSON |
| non_utf8_data          | line 25 of the data file has a 0xff byte           | 1    | DatasetFileError, bytes.jsonl:25, not UTF-8       |
| prompt_key_late        | row 25 of the data has no 'prompt' column (validation reads 20) | 1 | role rollout failed, KeyError, row 25, no 'prompt' column |
| reward_init_raises     | a reward plugin whose constructor raises           | 1    | failed while starting, RuntimeError, judge.bin    |
| truncated_weights      | ``--resume`` from a checkpoint whose weights are cut | 1  | failed while starting, the loader's error type    |
| garbage_optimizer      | ``--resume`` from a checkpoint whose optimizer.pt is garbage | 1 | failed while starting, the loader's error type |
| reward_wrong_count     | a reward returning one score fewer than samples    | 1    | short_scores, returned 127 scores for 128 samples |
| reward_fails_all_zero  | a reward failing on every sample under on_error: zero | 1 | always_raises, 100%, max_error_frac             |
| reward_hangs           | a reward that never returns, ``timeout_s: null``   | 1    | reward 'never_returns', progress_timeout_s        |
| reward_exits           | a reward that calls ``os._exit``                   | 1    | its process died, while busy with reward 'exits_process' |

The probes that need a checkpoint to corrupt, a hang to wait out or a process to die (truncated_weights,
garbage_optimizer, reward_hangs, reward_exits) run in the faults lane; the others in the default suite.

Separate tests (a setup of their own):

- ``test_empty_data_file_is_refused_before_anything_starts``: an empty data file -> exit 2, "no rows".
- ``test_sigterm_stops_like_ctrl_c_and_a_killed_driver_is_cleaned_up`` (faults lane): SIGTERM to
  ``relax run`` -> exit 130 and the ``--resume`` hint; ``--resume``, then ``kill -9`` of that driver;
  the next ``relax run --resume`` stops the killed driver's Ray processes and ends the run with every
  step in metrics.jsonl once; no process of any of the three Ray sessions is left.
- ``test_a_reward_over_its_error_share_stops_under_zero`` and ``test_a_hung_reward_is_named``: the
  scorer's threshold and the hang verdict's wording, without a run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from relax import testing

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

KIT = Path(__file__).parent / "kit"
ROOT = Path(__file__).parents[2]
ROWS = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(30)]


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def malformed_jsonl(folder: Path) -> list[str]:
    lines = _jsonl(ROWS).splitlines(keepends=True)
    lines.insert(25, b'{"prompt": "oops", \n')  # line 26: past the 20 rows validation reads
    (folder / "bad.jsonl").write_bytes(b"".join(lines))
    return [f"data.train={{source: {folder / 'bad.jsonl'}}}"]


def non_utf8_data(folder: Path) -> list[str]:
    lines = _jsonl(ROWS).splitlines(keepends=True)
    lines.insert(24, b'{"prompt": "\xff\xfe", "answer": "2"}\n')  # line 25
    (folder / "bytes.jsonl").write_bytes(b"".join(lines))
    return [f"data.train={{source: {folder / 'bytes.jsonl'}}}"]


def prompt_key_late(folder: Path) -> list[str]:
    rows = list(ROWS)
    rows[25] = {"promt": "25+25=", "answer": "50"}  # a typo in one row, past the 20 validation reads
    (folder / "typo.jsonl").write_bytes(_jsonl(rows))
    return [f"data.train={{source: {folder / 'typo.jsonl'}}}"]


def reward(entry: str) -> Callable[[Path], list[str]]:
    return lambda folder: [f"rewards=[{entry}]"]


def truncated_weights(checkpoint: Path) -> None:
    [weights] = checkpoint.glob("step-2/trainer/*.safetensors")
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])


def garbage_optimizer(checkpoint: Path) -> None:
    (checkpoint / "step-2" / "trainer" / "optimizer.pt").write_bytes(b"not a torch file\x00" * 64)


# The progress timeout also bounds a worker's start (loading the model, its first compile): 20 s leaves
# a start on a loaded 2-core box inside it (6 s did not, once), so only the reward's hang passes it.
HANG = ("fault_tolerance.heartbeat_s=0.5", "fault_tolerance.heartbeat_timeout_s=4",
        "fault_tolerance.progress_timeout_s=20", "fault_tolerance.roles.rollout.max_restarts=0")


@dataclass(frozen=True)
class Probe:
    name: str
    overrides: Callable[[Path], list[str]] = lambda folder: []
    corrupt: Callable[[Path], None] | None = None
    """Corrupts a copy of a 2-step run's checkpoints, then the probe resumes from it."""
    code: int = 1
    words: tuple[str, ...] = ()
    extra: tuple[str, ...] = field(default=())


TABLE = [
    Probe("malformed_jsonl", malformed_jsonl,
          words=("failed while starting", "DatasetFileError", "bad.jsonl:26", "invalid JSON")),
    Probe("non_utf8_data", non_utf8_data,
          words=("failed while starting", "DatasetFileError", "bytes.jsonl:25", "not UTF-8")),
    Probe("prompt_key_late", prompt_key_late,
          words=("role rollout failed", "KeyError", "row 25 of the training data has no 'prompt' column")),
    Probe("reward_init_raises", reward("{name: init_fails}"),
          words=("failed while starting", "RuntimeError", "init_fails", "judge.bin is missing")),
    Probe("truncated_weights", corrupt=truncated_weights, words=("failed while starting", "Error")),
    Probe("garbage_optimizer", corrupt=garbage_optimizer, words=("failed while starting", "Error")),
    Probe("reward_wrong_count", reward("{name: short_scores}"),
          words=("RewardError", "short_scores", "returned 127 scores for 128 samples")),
    Probe("reward_fails_all_zero", reward("{name: always_raises, on_error: zero}"),
          words=("RewardError", "always_raises", "(100%)", "max_error_frac")),
    Probe("reward_hangs", reward("{name: never_returns, timeout_s: null}"), extra=HANG,
          words=("busy with reward 'never_returns' (never_returns)", "progress_timeout_s", "rewards[].timeout_s")),
    Probe("reward_exits", reward("{name: exits_process}"), extra=("fault_tolerance.roles.rollout.max_restarts=0",),
          words=("its process died", "while busy with reward 'exits_process' (exits_process)")),
]


@pytest.fixture(scope="module")
def hostile_ray():
    """One Ray for the module; its workers (and this process's registry) see the plugins of ``kit``."""
    import relax.registry

    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(KIT))
        paths = [str(KIT), str(ROOT), os.environ.get("PYTHONPATH", "")]
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
        mp.setattr(relax.registry, "_default", None)  # rediscover with the kit's plugins
        with testing.local_ray():
            yield


@pytest.fixture(scope="module")
def checkpointed(hostile_ray, tmp_path_factory) -> Path:
    """A 2-step run with its checkpoint of step 2, for the probes that corrupt one."""
    root = tmp_path_factory.mktemp("checkpointed")
    code, rows, _ = testing.tiny_run(root, "base", "trainer.steps=2", "trainer.checkpoint_every=2")
    assert code == 0 and len(rows) == 2
    return root / "base"


#: Probes that cost a run more (a checkpoint to corrupt, a hang to wait out) run in the faults lane.
SLOW = {"truncated_weights", "garbage_optimizer", "reward_hangs", "reward_exits"}


@pytest.mark.parametrize("probe", [pytest.param(p, id=p.name, marks=[pytest.mark.faults] if p.name in SLOW else [])
                                   for p in TABLE])
def test_every_failure_ends_with_its_cause(hostile_ray, probe: Probe, tmp_path: Path, capsys, request) -> None:
    resume = probe.corrupt is not None
    if resume:
        shutil.copytree(request.getfixturevalue("checkpointed"), tmp_path / probe.name)
        probe.corrupt(tmp_path / probe.name / "checkpoints")
    overrides = [*probe.overrides(tmp_path), *probe.extra, *(["trainer.steps=4", "trainer.checkpoint_every=2"]
                                                             if resume else [])]
    started = time.monotonic()
    code, _, _ = testing.tiny_run(tmp_path, probe.name, *overrides, resume=resume)
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert code == probe.code, err
    assert last.startswith("relax run: the run failed: "), err
    for word in probe.words:
        assert word in last, (word, last)
    assert "restarted in place" not in err  # stopped at once: no restart spent on it
    assert "The actor died" not in err
    assert time.monotonic() - started < 60


def test_empty_data_file_is_refused_before_anything_starts(tmp_path: Path, capsys) -> None:
    from relax.cli import main

    (tmp_path / "empty.jsonl").write_text("")
    assert main(["run", "tiny-cpu", f"data.train={{source: {tmp_path / 'empty.jsonl'}}}",
                 f"trainer.output_dir={tmp_path / 'out'}"]) == 2
    assert "has no rows" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_reward_over_its_error_share_stops_under_zero() -> None:
    from relax.contracts import RewardSample
    from relax.runtime.worker.scoring import RewardEntry, RewardError, RewardScorer

    class FailsOnOdd:
        def score(self, samples):
            if len(samples) > 1:
                raise ValueError("batch")
            if samples[0].metadata["sample_id"] % 2:
                raise ValueError("odd")
            return [1.0]

    batch = [RewardSample(prompt="p", response="r", label="l", metadata={"sample_id": i}) for i in range(4)]
    half = RewardScorer([RewardEntry(key="odd", name="fails_on_odd", plugin=FailsOnOdd(), on_error="zero")])
    assert half.score(batch).errors == {"odd": 2}  # 50% is not more than the default 0.5
    strict = RewardScorer([RewardEntry(key="odd", name="fails_on_odd", plugin=FailsOnOdd(), on_error="zero",
                                       max_error_frac=0.25)])
    with pytest.raises(RewardError) as info:
        strict.score(batch)
    assert "reward 'odd' (fails_on_odd) failed on 2 of 4 samples (50%)" in str(info.value)
    assert "max_error_frac=0.25" in str(info.value) and "ValueError: odd" in str(info.value)


@pytest.mark.faults  # a restart: the worker starts twice
def test_a_transient_failure_is_restarted_and_the_run_goes_on(hostile_ray, tmp_path: Path, capsys) -> None:
    marker = tmp_path / "failed-once"
    code, rows, _ = testing.tiny_run(tmp_path, "flaky", "trainer.steps=3",
                                     f"rewards=[{{name: flaky_once, options: {{marker: {marker}}}}}]")
    err = capsys.readouterr().err
    assert code == 0, err
    assert marker.exists() and [r["step"] for r in rows] == [1, 2, 3]
    restarts = [line for line in err.splitlines() if "restarted in place" in line]
    assert len(restarts) == 1 and "TransientError: flaky_once: the judge service did not answer" in restarts[0], err


def test_a_transient_reward_failure_leaves_the_scorer_as_itself() -> None:
    from relax.contracts import RewardSample, TransientError
    from relax.runtime.worker.scoring import RewardEntry, RewardScorer

    class Down:
        calls = 0

        def score(self, samples):
            Down.calls += 1
            raise TransientError("judge down")

    batch = [RewardSample(prompt="p", response="r", label="l", metadata={"sample_id": i}) for i in range(4)]
    scorer = RewardScorer([RewardEntry(key="judge", name="down", plugin=Down(), on_error="zero")])
    with pytest.raises(TransientError, match="judge down"):
        scorer.score(batch)
    assert Down.calls == 1  # not asked again sample by sample, and not scored 0 under on_error: zero


def test_a_hung_reward_is_named() -> None:
    from relax.runtime.state.health import hung_workers
    from relax.runtime.state.records import Beat

    beats = {"rollout": Beat(at=100.0, activity="reward 'judge' (remote) scoring 16 samples of step 3",
                             busy_since=10.0)}
    [verdict] = hung_workers(beats, {"rollout": 0.0}, 100.0, 30.0, 60.0)
    assert "busy with reward 'judge' (remote)" in verdict.reason and "rewards[].timeout_s" in verdict.reason


# -- SIGTERM and SIGKILL of the driver ----------------------------------------------------------


def _session(state: Path, timeout_s: float = 120) -> dict:
    """The record of the one live embedded Ray session under the state folder ``state``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [json.loads(p.read_text()) for p in (state / "ray-sessions").glob("*.json")]
        if found:
            return found[0]
        time.sleep(0.2)
    raise TimeoutError("no Ray session was recorded")


def _leftovers(session: dict) -> list[str]:
    """Processes of a recorded session still running: its recorded pids (same start time), those
    whose command line names its session folder, and workers of its raylet."""
    import psutil

    recorded = {int(entry["pid"]): entry["started"] for entry in session.get("processes", [])}
    left = []
    for process in psutil.process_iter(["pid", "cmdline", "create_time"]):
        try:
            mine = recorded.get(process.pid) == process.info["create_time"]
            named = session["session_dir"] in " ".join(process.info["cmdline"] or ())
            raylet = process.environ().get("RAY_RAYLET_PID")
            worker = raylet is not None and int(raylet) in recorded
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if mine or named or worker:
            left.append(f"{process.pid} {' '.join(process.info['cmdline'] or ())[:120]}")
    return left


@pytest.mark.faults  # three Ray starts in processes of their own: over a minute
def test_sigterm_stops_like_ctrl_c_and_a_killed_driver_is_cleaned_up(tmp_path: Path) -> None:
    steps = 60
    state = tmp_path / "state"
    env = {"RELAX_STATE_DIR": str(state), "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    # Every checkpoint kept: a driver killed while it lags its workers may leave metrics.jsonl behind
    # the two newest checkpoints, and resuming past its last row is another matter than this one.
    args = ("placement.mode=colocate", "async_policy.max_staleness=0", "trainer.checkpoint_every=2",
            f"trainer.steps={steps}", f"trainer.keep_checkpoints={steps}")
    first = testing.LiveRun(tmp_path, "term", *args, env=env).start()
    first.wait_rows(3)
    session = _session(state)
    first.process.send_signal(signal.SIGTERM)
    assert first.wait(120) == 130, first.output()
    last = first.output().strip().splitlines()[-1]
    assert "terminated (SIGTERM)" in last and "--resume" in last, last
    assert _leftovers(session) == []

    second = testing.LiveRun(tmp_path, "term", *args, resume=True, env=env).start()
    second.wait_rows(len(first.rows()) + 3)
    killed = _session(state)
    second.process.kill()  # kill -9 of the driver: its Ray cannot be stopped by it
    second.wait(60)
    time.sleep(2)
    assert _leftovers(killed), "kill -9 of the driver left nothing behind: this test checks nothing"

    third = testing.LiveRun(tmp_path, "term", *args, resume=True, env=env).start()
    assert third.wait(300) == 0, third.output()
    assert "leftover processes of a killed run's Ray" in third.output()
    assert _leftovers(killed) == []
    assert [r["step"] for r in third.rows()] == list(range(1, steps + 1))
    assert list((state / "ray-sessions").glob("*.json")) == []
