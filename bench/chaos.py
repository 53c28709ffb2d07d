"""Chaos: the fault scenarios of tests/runtime/test_faults.py again and again, at random moments.

    python bench/chaos.py [--trials 3] [--seed 0] [--steps 30] [--out DIR]
                          [--scenarios kill-rollout,kill-actor,freeze-rollout,scale]

First one undisturbed reference run of the tiny CPU preset (separate mode, the overrides of the
fault tests, ``--steps`` steps). Then, per scenario, ``--trials`` runs (``relax.testing.LiveRun``,
each ``relax run`` in a process of its own) that are disturbed once, after a random number of step
rows in [1, steps / 3] plus a random 0-1 s (early enough that the run still needs the worker: a
tiny step takes a fifth of a second):

- kill-rollout: ``kill -9`` of the worker hosting the rollout (restarted in place);
- kill-actor: ``kill -9`` of the trainer's worker (the run resumes from its last checkpoint);
- freeze-rollout: ``SIGSTOP`` of the rollout's worker (found by its missing heartbeats, restarted);
- scale: an elastic run (``roles.rollout.max_replicas=2``) goes to 2 rollout replicas, and back to
  1 three rows later.

Per trial it prints the exit code, the step rows, the final sample counters (produced, consumed,
regenerated, dropped), faults/restarts, the wall time, and whether every step trained the same
data as the reference (``data/order`` and ``samples/trained_hash``; a scale run cuts each step into
two units, so only its step count, counters and ``data/order`` are compared). Per scenario: how
many trials completed, were exactly-once (produced == consumed == steps x batch; after a resume
the counters restart from the checkpoint, so kill-actor checks produced == consumed only) and
trained the reference's data, and the mean wall time. For scale it also prints the samples/s of
the 1-replica and the 2-replica steps, from the times this script saw each row appear (measured
on this machine, whose cores the replicas share). Exit 1 unless every trial completed and was
exactly-once. Each run takes about a minute on a laptop CPU.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCENARIOS = ("kill-rollout", "kill-actor", "freeze-rollout", "scale")
BATCH = 16 * 8  # prompts_per_step x samples_per_prompt of tiny-cpu
#: Steps of a scale run: long enough for a second replica to build its model and join.
SCALE_STEPS = 80

RUN_TIMEOUT_S = 900.0


@dataclass
class Trial:
    """One run and what became of it."""

    scenario: str
    index: int
    at_row: int = 0
    extra_s: float = 0.0
    code: int | str = "-"
    rows: list[dict[str, Any]] = field(default_factory=list)
    seen: dict[int, float] = field(default_factory=dict)
    """Step -> time.time() when this script first saw its row."""
    wall_s: float = 0.0
    same_data: bool = False
    steps: int = 0
    """Steps of this trial's run (a scale run is longer: a new replica takes seconds to build)."""
    note: str = ""

    @property
    def last(self) -> dict[str, Any]:
        return self.rows[-1] if self.rows else {}

    def completed(self) -> bool:
        return self.code == 0 and [r["step"] for r in self.rows] == list(range(1, self.steps + 1))

    def exactly_once(self) -> bool:
        produced, consumed = self.last.get("samples/produced"), self.last.get("samples/consumed")
        if produced is None or produced != consumed:
            return False
        return self.scenario == "kill-actor" or consumed == self.steps * BATCH


def rows_of(run: Any) -> list[dict[str, Any]]:
    """The run's rows; [] while metrics.jsonl is being rewritten (a resume) or a line is half written."""
    try:
        return run.rows()
    except ValueError:
        return []


def follow(run: Any, trial: Trial, until: Any, timeout_s: float = RUN_TIMEOUT_S) -> list[dict[str, Any]]:
    """Poll the run's rows every 0.2 s, stamping each new step with the time it was seen, until
    ``until(rows)`` holds or the run ends."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = rows_of(run)
        now = time.time()
        steps = {r["step"] for r in rows}
        for step in [s for s in trial.seen if s not in steps]:  # a resume dropped rows past its checkpoint
            del trial.seen[step]
        for step in steps:
            trial.seen.setdefault(step, now)
        if until(rows) or run.process.poll() is not None:
            return rows
        if time.monotonic() > deadline:
            raise TimeoutError(f"{trial.scenario} #{trial.index}: no progress within {timeout_s:.0f} s")
        time.sleep(0.2)


def in_background(run: Any, trial: Trial, call: Any) -> Any:
    """Run ``call()`` (a blocking control request) while following the rows; its result or error."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = call()
        except Exception as exc:  # noqa: BLE001 (reported in the trial's note)
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    follow(run, trial, lambda rows: not thread.is_alive())
    thread.join(timeout=30)  # the run ended meanwhile: its control endpoint is gone
    if "error" in box:
        raise box["error"]
    return box.get("result")


def disturb(run: Any, trial: Trial) -> int | None:
    """The scenario's disturbance; returns the pid of a worker it froze, if any."""
    from relax.runtime.driver.control import ControlError

    if trial.scenario == "kill-rollout":
        run.kill_worker("rollout")
    elif trial.scenario == "kill-actor":
        run.kill_worker("actor")
    elif trial.scenario == "freeze-rollout":
        return run.signal_worker("rollout", signal.SIGSTOP)["pid"]
    elif trial.scenario == "scale":
        try:
            in_background(run, trial, lambda: run.scale(2))
            grown_at = len(rows_of(run))
            follow(run, trial, lambda rows: len(rows) >= grown_at + 3)
            if run.process.poll() is None:
                in_background(run, trial, lambda: run.scale(1))
            else:
                trial.note = "ended before scale(1)"
        except ControlError as exc:
            trial.note = f"scale: {exc}"
    return None


def run_trial(root: Path, trial: Trial, steps: int, rng: random.Random, reference: list[dict]) -> Trial:
    from relax.testing import FAULT_TEST_OVERRIDES as FAULTS, LiveRun

    extra = ["roles.rollout.max_replicas=2"] if trial.scenario == "scale" else []
    trial.steps = max(steps, SCALE_STEPS) if trial.scenario == "scale" else steps
    trial.at_row, trial.extra_s = rng.randint(1, max(1, steps // 3)), rng.uniform(0.0, 1.0)
    started = time.monotonic()
    run = LiveRun(root, f"{trial.scenario}-{trial.index}", *FAULTS, f"trainer.steps={trial.steps}", *extra).start()
    frozen = None
    try:
        follow(run, trial, lambda rows: len(rows) >= trial.at_row)
        pause_until = time.monotonic() + trial.extra_s
        follow(run, trial, lambda rows: time.monotonic() >= pause_until)
        if run.process.poll() is None:
            frozen = disturb(run, trial)
        else:
            trial.note = "ended before the disturbance"
        follow(run, trial, lambda rows: False)
        trial.code = run.wait(timeout_s=60)
    except Exception as exc:  # noqa: BLE001 (a trial that breaks is reported, the others go on)
        trial.note = trial.note or f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        if run.process.poll() is None:
            run.process.kill()
        trial.code = run.wait(timeout_s=60)
    finally:
        if frozen is not None:  # a frozen worker the run did not replace must not outlive the bench
            try:
                os.kill(frozen, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    trial.wall_s = time.monotonic() - started
    trial.rows = rows_of(run)
    # A scale run is longer and cuts steps in two units: compare its first steps' prompts only.
    trial.same_data = same_data(trial.rows[:len(reference)], reference, hashes=trial.scenario != "scale")
    return trial


def same_data(rows: list[dict], reference: list[dict], hashes: bool) -> bool:
    if [r["step"] for r in rows] != [r["step"] for r in reference]:
        return False
    if [r.get("data/order") for r in rows] != [r.get("data/order") for r in reference]:
        return False
    return not hashes or [r.get("samples/trained_hash") for r in rows] == [
        r.get("samples/trained_hash") for r in reference]


def throughput(trial: Trial) -> dict[int, float]:
    """Samples/s per rollout/step_replicas, over the time between consecutive rows as seen here."""
    samples: dict[int, float] = {}
    seconds: dict[int, float] = {}
    for before, row in zip(trial.rows, trial.rows[1:]):
        if before["step"] not in trial.seen or row["step"] not in trial.seen:
            continue
        replicas = row.get("rollout/step_replicas", 1)
        samples[replicas] = samples.get(replicas, 0) + BATCH
        seconds[replicas] = seconds.get(replicas, 0.0) + trial.seen[row["step"]] - trial.seen[before["step"]]
    return {n: samples[n] / seconds[n] for n in samples if seconds[n] > 0}


HEADER = (f"{'scenario':<15}{'#':>3}{'at row':>7}{'+s':>6}{'exit':>6}{'rows':>6}{'produced':>10}{'consumed':>10}"
          f"{'regen':>7}{'dropped':>8}{'restarts':>9}{'wall s':>8}  same data  note")


def line(trial: Trial) -> str:
    last = trial.last
    return (f"{trial.scenario:<15}{trial.index:>3}{trial.at_row:>7}{trial.extra_s:>6.2f}{trial.code!s:>6}"
            f"{len(trial.rows):>6}{last.get('samples/produced', '-')!s:>10}{last.get('samples/consumed', '-')!s:>10}"
            f"{last.get('samples/regenerated', '-')!s:>7}{last.get('samples/dropped', '-')!s:>8}"
            f"{last.get('faults/restarts', '-')!s:>9}{trial.wall_s:>8.1f}  {'yes' if trial.same_data else 'NO':<9}  "
            f"{trial.note}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3, help="disturbed runs per scenario")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random disturbance times")
    parser.add_argument("--steps", type=int, default=30, help="steps of every run (at least 4)")
    parser.add_argument("--out", default=None, help="where runs and their logs go (default: a new temp dir, kept)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset of "
                        + ",".join(SCENARIOS))
    args = parser.parse_args()
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if unknown := [s for s in scenarios if s not in SCENARIOS]:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    if args.steps < 4:
        parser.error("--steps must be at least 4 (the disturbance comes after 1 to steps/3 rows)")
    from relax.testing import FAULT_TEST_OVERRIDES as FAULTS, LiveRun

    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="relax-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"runs and logs under {root}", flush=True)
    rng = random.Random(args.seed)

    started = time.monotonic()
    ref_run = LiveRun(root, "reference", *FAULTS, f"trainer.steps={args.steps}").start()
    code = ref_run.wait(timeout_s=RUN_TIMEOUT_S)
    reference = rows_of(ref_run)
    last = reference[-1] if reference else {}
    print(f"reference: exit {code}, {len(reference)} rows, produced {last.get('samples/produced')}, consumed "
          f"{last.get('samples/consumed')}, {time.monotonic() - started:.1f} s", flush=True)
    if code != 0 or len(reference) != args.steps:
        print(f"the undisturbed reference run failed; see {ref_run.log}")
        return 1

    print("\n" + HEADER, flush=True)
    trials: list[Trial] = []
    for scenario in scenarios:
        for index in range(1, args.trials + 1):
            trial = run_trial(root, Trial(scenario, index), args.steps, rng, reference)
            trials.append(trial)
            print(line(trial), flush=True)

    print()
    ok = True
    for scenario in scenarios:
        mine = [t for t in trials if t.scenario == scenario]
        completed = sum(t.completed() for t in mine)
        once = sum(t.exactly_once() for t in mine)
        ok = ok and completed == once == len(mine)
        print(f"{scenario:<15} trials {len(mine)}  completed {completed}/{len(mine)}  exactly-once {once}/{len(mine)}  "
              f"same data {sum(t.same_data for t in mine)}/{len(mine)}  "
              f"mean wall {statistics.mean(t.wall_s for t in mine):.1f} s", flush=True)
        if scenario == "scale":
            rates: dict[int, list[float]] = {}
            for trial in mine:
                for replicas, rate in throughput(trial).items():
                    rates.setdefault(replicas, []).append(rate)
            phases = "  ".join(f"{n} replica{'s' if n > 1 else ''}: {statistics.mean(r):.1f} samples/s"
                               for n, r in sorted(rates.items()))
            print(f"{'':<15} throughput measured on this machine, between rows as seen: {phases or 'no rows'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
