"""Where a step's time goes: Relax's runtime against its own plugins driven in one process, and
asynchronous (separate) against colocated training.

    python bench/step_time.py [--steps 60] [--skip 10] [--repeats 2] [key=value ...]

Why: the runtime (Ray actors, the control plane, the bus, weight channels) must cost little over
the work itself, or a user timing us against a synchronous trainer picks the trainer. On one
embedded Ray (with the environment ``relax run`` gives its own), alternating the sides so drift on
a shared machine hits all alike, it runs the tiny CPU preset:

- **plugins**: the synchronous loop of ``bench/learn_tiny.py`` in this process: the same plugins
  (hf rollout, exact_match, grpo, torch trainer) with no runtime, and the torch threads the
  colocated worker gets;
- **colocate** (max_staleness 0): one worker alternates generating and training, rows in memory;
- **separate** (max_staleness 1): the rollout generates the next batch while the actor trains;
- **async** (separate, max_staleness 2): the rollout may run two steps ahead, so its loop with the
  actor (publish, load, generate, put, train) spans three steps instead of two.

It prints per side the steady s/step (median over the steps after ``--skip``, then the median of
the repeats, with their range), the work in a step (generating + scoring + training) and the work
share (``time/work_frac``: work / step time), then the ratios issue 17 asks for: colocate over
plugins (at most 1.1x), separate's speedup over colocate (at least 1.3x), and the work shares (at
least 0.85 colocated, 0.9 separate). The Relax paper reports 1.76x-2.00x async speedups on GPUs.

It also prints the CPU a steady step costs on each side: every process of this bench's tree
(this one, Ray's daemons, the run's actors), split into the role workers (``ray::RoleWorker``,
``ray::RankWorker``) and the rest (the run's control plane, the bus, Ray), and how many cores
that keeps busy. Separate mode overlaps generating with training only while cores are free: its
step cannot be shorter than its CPU per step over the machine's cores (the "CPU floor" printed),
so colocate's step over that floor is the most speedup the machine allows, printed last: on the
2-core box separate mode spends more CPU a step than colocate (the bus, the second model, the
weights' way), so its bound there is under 1x whatever the runtime does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from tiny_runs import run_tiny  # noqa: E402

#: The Relax sides: placement mode and staleness bound (``async``: separate with two steps of slack).
MODES = {"colocate": ("colocate", 0), "separate": ("separate", 1), "async": ("separate", 2)}


@dataclass
class Side:
    """One way of running the work, over the repeats."""

    name: str
    step_s: list[float] = field(default_factory=list)
    work_s: list[float] = field(default_factory=list)
    share: list[float] = field(default_factory=list)
    cpu: list[dict[str, float]] = field(default_factory=list)
    """Per repeat, CPU seconds a steady step cost: ``workers``, ``rest``."""

    def add(self, step_s: list[float], work_s: list[float], share: list[float], cpu: dict[str, float]) -> None:
        self.step_s.append(statistics.median(step_s))
        self.work_s.append(statistics.median(work_s))
        self.share.append(statistics.median(share))
        self.cpu.append(cpu)

    def cpu_ms(self) -> tuple[float, float]:
        """CPU-ms of a steady step: the workers', and every other process's."""
        return tuple(statistics.median(c[k] for c in self.cpu) * 1000 for k in ("workers", "rest"))

    def cpu_floor_ms(self, cores: int) -> float:
        """The shortest step these cores allow for this side's CPU, were every core busy all the time."""
        return sum(self.cpu_ms()) / cores

    def cpu_line(self, cores: int) -> str:
        workers, rest = self.cpu_ms()
        step_ms = statistics.median(self.step_s) * 1000
        return (f"{self.name:>9} | {workers + rest:6.1f} | {workers:7.1f} | {rest:6.1f} | "
                f"{(workers + rest) / step_ms:5.2f} | {self.cpu_floor_ms(cores):5.1f}")

    def line(self, base: float | None) -> str:
        med = statistics.median(self.step_s)
        ratio = f"{med / base:.2f}x" if base else "-"
        return (f"{self.name:>9} | {med:.4f} ({min(self.step_s):.4f}-{max(self.step_s):.4f}) | "
                f"{statistics.median(self.work_s):.4f} | {statistics.median(self.share):.2f} | {ratio:>8}")


#: Process titles of the processes that do a run's work (generate, score, train); the rest of the
#: tree is the runtime's (control plane, bus, Ray's daemons) or this bench's.
WORK_TITLES = ("ray::RoleWorker", "ray::RankWorker")


def tree_cpu() -> dict[int, tuple[bool, float]]:
    """Per process of this bench's tree: whether it is a role worker, and its CPU seconds so far."""
    out = {}
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            with proc.oneshot():
                times = proc.cpu_times()
                title = " ".join(proc.cmdline()[:1])
        except psutil.Error:  # ended meanwhile
            continue
        out[proc.pid] = (title.startswith(WORK_TITLES), times.user + times.system)
    return out


def cpu_per_step(before: dict[int, tuple[bool, float]], after: dict[int, tuple[bool, float]],
                 steps: int) -> dict[str, float]:
    """CPU seconds per step between two ``tree_cpu`` snapshots, role workers apart from the rest
    (a process started in between counts from zero)."""
    spent = {"workers": 0.0, "rest": 0.0}
    for pid, (work, cpu) in after.items():
        spent["workers" if work else "rest"] += cpu - before.get(pid, (work, 0.0))[1]
    return {k: v / steps for k, v in spent.items()}


class StepWatch:
    """Snapshots ``tree_cpu`` when a run has done ``skip`` steps and when it has done all but its
    last ``END_MARGIN`` (well before the run's end stops its processes), so the figure covers
    steady steps only.

    A run in other processes is polled (``done()``: steps done so far, read in a thread); a loop in
    this process calls ``mark`` after each step instead, because a step of it can be shorter than
    the poll."""

    POLL_S = 0.02
    END_MARGIN = 15
    """Steps left after the second snapshot: the controller writes rows up to 0.1 s late
    (``WATCH_INTERVAL_S``), several at once (seven of the tiny preset's colocated steps), and a
    snapshot taken after the workers ended would miss their CPU."""

    def __init__(self, skip: int, steps: int, done: Callable[[], int] | None = None) -> None:
        self.skip, self.steps = skip, steps
        self.snaps: list[tuple[int, dict[int, tuple[bool, float]]]] = []
        self._stop = threading.Event()
        self._thread = None
        if done is not None:
            self._thread = threading.Thread(target=self._poll, args=(done,), name="cpu-watch", daemon=True)
            self._thread.start()

    def _poll(self, done: Callable[[], int]) -> None:
        for target in (self.skip, self.steps - self.END_MARGIN):
            while not self._stop.is_set() and (n := done()) < target:
                self._stop.wait(self.POLL_S)
            if self._stop.is_set():
                return
            self.snaps.append((n, tree_cpu()))

    def mark(self, done: int) -> None:
        """``done`` steps are done (a loop in this process)."""
        if done in (self.skip, self.steps - self.END_MARGIN):
            self.snaps.append((done, tree_cpu()))

    def result(self) -> dict[str, float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if len(self.snaps) < 2 or self.snaps[1][0] <= self.snaps[0][0]:
            raise SystemExit(f"the CPU watch missed the run's steady steps; run more --steps than --skip + {self.END_MARGIN}")
        (n0, before), (n1, after) = self.snaps
        ended = [pid for pid, (work, _) in before.items() if work and pid not in after]
        if ended:
            raise SystemExit(f"the CPU watch's second snapshot came after role workers {ended} ended: "
                             "the figure would leave out their CPU")
        return cpu_per_step(before, after, n1 - n0)


def metrics_rows(path: Path) -> int:
    """Steps a run has logged so far (lines of its metrics.jsonl)."""
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def plugins_once(steps: int, skip: int, threads: int) -> tuple[list[float], list[float], list[float], dict]:
    """The synchronous loop over the built-in plugins, in this process."""
    import torch

    from learn_tiny import BENCH_SPEC, run
    from relax.spec import validate_spec

    torch.set_num_threads(threads)
    spec = validate_spec(dict(BENCH_SPEC, trainer={"steps": steps}))
    watch = StepWatch(skip, steps)
    logged = [0]

    def log(line: str) -> None:
        if line.startswith("step "):
            logged[0] += 1
            watch.mark(logged[0])

    records = run(spec, os.environ.get("RELAX_CACHE", "~/.cache/relax"), steps, log=log)[skip:]
    step_s = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(records, records[1:])]
    work_s = [r["generate_s"] + r["score_s"] + r["train_s"] for r in records]
    return step_s, work_s, [w / s for w, s in zip(work_s[1:], step_s)], watch.result()


def colocated_threads(root: Path, overrides: list[str]) -> int:
    """The torch threads the plan gives the colocated worker (every role in one process): what the
    plugins side runs with, so both sides do the same work on the same threads."""
    from relax.testing import tiny_spec

    _, plan, _ = tiny_spec(root, "threads", *overrides, "placement.mode=colocate", "async_policy.max_staleness=0")
    return plan.workers[0].threads


def relax_once(mode: str, steps: int, skip: int, root: Path, tag: str,
               extra: list[str]) -> tuple[list[float], list[float], list[float], dict]:
    placement, staleness = MODES[mode]
    name = f"{mode}-{tag}"
    watch = StepWatch(skip, steps, lambda: metrics_rows(root / name / "metrics.jsonl"))
    rows = run_tiny(name, root, [f"trainer.steps={steps}", f"placement.mode={placement}",
                                 f"async_policy.max_staleness={staleness}", "tracing.exporter=none", *extra])[skip:]
    work = [r["time/rollout_s"] + r["time/reward_s"] + r["time/advantage_s"] + r["time/train_s"] for r in rows]
    return [r["time/step_s"] for r in rows], work, [r["time/work_frac"] for r in rows], watch.result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=10, help="first steps left out (warm-up)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the Relax runs")
    args = parser.parse_args()
    import ray

    from relax.runtime.driver.launch import EMBEDDED_RAY_CPUS, embedded_ray_env

    os.environ.update(embedded_ray_env())  # what the embedded Ray of `relax run` gets
    ray.init(address="local", num_cpus=EMBEDDED_RAY_CPUS, include_dashboard=False, log_to_driver=False)
    sides = {name: Side(name) for name in ("plugins", *MODES)}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            threads = colocated_threads(Path(tmp), args.overrides)
            for r in range(args.repeats):
                sides["plugins"].add(*plugins_once(args.steps, args.skip, threads))
                for mode in MODES:
                    sides[mode].add(*relax_once(mode, args.steps, args.skip, Path(tmp), str(r), args.overrides))
    finally:
        ray.shutdown()

    base = statistics.median(sides["plugins"].step_s)
    print(f"\ntiny preset, {args.steps} steps, steady state after {args.skip}, median of {args.repeats} "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {threads} torch thread(s) in "
          "the plugins' process and the colocated worker)")
    header = f"{'':>9} | {'s/step (range)':^24} | {'work s':^6} | share | {'/plugins':>8}"
    print(header)
    print("-" * len(header))
    for side in sides.values():
        print(side.line(base))
    colocate, separate, ahead = (statistics.median(sides[m].step_s) for m in MODES)
    print(f"\ncolocate / plugins in one process: {colocate / base:.2f}x (issue 17: at most 1.10x)")
    print(f"separate speedup over colocate:    {colocate / separate:.2f}x (at least 1.3x)")
    print(f"async speedup over colocate:       {colocate / ahead:.2f}x (max_staleness 2)")
    print(f"work share: colocate {statistics.median(sides['colocate'].share):.2f} (at least 0.85), "
          f"separate {statistics.median(sides['separate'].share):.2f} (at least 0.9)")
    cores = psutil.cpu_count() or 1
    print(f"\nCPU of a steady step, every process of the run (median of the repeats), on {cores} CPUs:")
    header = f"{'':>9} | CPU ms | workers | others | cores | CPU floor ms/step"
    print(header)
    print("-" * len(header))
    for side in sides.values():
        print(side.cpu_line(cores))
    # A speedup needs idle cores: a side whose CPU floor is near colocate's step cannot beat it here.
    for mode in ("separate", "async"):
        bound = colocate * 1000 / sides[mode].cpu_floor_ms(cores)
        print(f"{mode} speedup over colocate these {cores} CPUs allow at most: {bound:.2f}x "
              "(colocate's step over this side's CPU floor)")


if __name__ == "__main__":
    main()
