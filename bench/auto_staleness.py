"""``async_policy.max_staleness: auto`` against the fixed bounds 0, 1, 2 and 4 on the tiny preset
(separate mode), side by side in one invocation.

Each arm is a whole ``relax run`` of ``tiny-cpu`` (model built once, cached); the arms take turns
run by run (the order rotates) so a slow moment of the machine is spread over all of them. Run r
of every arm uses ``seed=r`` (data order and sampling), so the spread of an arm's rewards over its
runs is the noise its reward is compared within.
Printed per arm (medians over runs): steady steps per second (after the first few steps), the
final reward (mean ``reward/mean`` of the last ten steps) with its spread over runs, the mean
``offpolicy/kl`` and, for auto, the bounds it chose. Then auto's steps per second against the
fastest fixed bound and its reward against the best one.

    python bench/auto_staleness.py                 # 2 runs per arm, 60 steps
    python bench/auto_staleness.py --runs 3 --steps 80
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relax.testing import tiny_run  # noqa: E402

ARMS = {"k0": "0", "k1": "1", "k2": "2", "k4": "4", "auto": "auto"}


def one_run(root: Path, name: str, bound: str, steps: int, skip: int, seed: int) -> dict:
    code, rows, printed = tiny_run(root, name, "tracing.exporter=none", "trainer.checkpoint_every=0", f"seed={seed}",
                                   f"trainer.steps={steps}", "placement.mode=separate",
                                   f"async_policy.max_staleness={bound}")
    if code != 0:
        raise SystemExit(f"the {name} run failed (exit {code}):\n{printed[-2000:]}")
    steady = [r["time/step_s"] for r in rows[skip:]]
    kls = [r["offpolicy/kl"] for r in rows if "offpolicy/kl" in r]
    return {"steps_per_s": len(steady) / sum(steady),
            "final_reward": statistics.mean(r["reward/mean"] for r in rows[-10:]),
            "offpolicy_kl": statistics.mean(kls) if kls else 0.0,
            "bounds": Counter(r["staleness/bound"] for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="runs per arm")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of steps per second")
    args = parser.parse_args()
    names = list(ARMS)
    results: dict[str, list[dict]] = {arm: [] for arm in names}
    with tempfile.TemporaryDirectory(prefix="relax-auto-bench-") as tmp:
        for run in range(args.runs):
            order = names[run % len(names):] + names[:run % len(names)]
            for arm in order:
                got = one_run(Path(tmp), f"{arm}-{run}", ARMS[arm], args.steps, args.skip, seed=run)
                results[arm].append(got)
                print(f"  run {run} {arm:5s} {got['steps_per_s']:6.2f} steps/s  reward {got['final_reward']:.3f}  "
                      f"offpolicy/kl {got['offpolicy_kl']:.4f}", flush=True)
    print(f"\ntiny-cpu, separate mode, {args.steps} steps, {args.runs} run(s) per arm (medians over runs)")
    print(f"{'arm':5s} {'steps/s':>8s} {'reward(last10)':>15s} {'per run':>20s} {'offpolicy/kl':>13s}  bounds chosen")
    med = {}
    for arm in names:
        runs = results[arm]
        med[arm] = {k: statistics.median(r[k] for r in runs) for k in ("steps_per_s", "final_reward", "offpolicy_kl")}
        bounds = sum((r["bounds"] for r in runs), Counter())
        shown = ", ".join(f"{b}: {n}" for b, n in sorted(bounds.items())) if arm == "auto" else ""
        per_run = " ".join(f"{r['final_reward']:.3f}" for r in runs)
        print(f"{arm:5s} {med[arm]['steps_per_s']:8.2f} {med[arm]['final_reward']:15.3f} {per_run:>20s} "
              f"{med[arm]['offpolicy_kl']:13.4f}  {shown}")
    fixed = [a for a in names if a != "auto"]
    fastest = max(fixed, key=lambda a: med[a]["steps_per_s"])
    best = max(fixed, key=lambda a: med[a]["final_reward"])
    print(f"\nauto's steps/s / fastest fixed ({fastest}): {med['auto']['steps_per_s'] / med[fastest]['steps_per_s']:.2f}x; "
          f"auto's final reward {med['auto']['final_reward']:.3f} vs best fixed ({best}) {med[best]['final_reward']:.3f}")


if __name__ == "__main__":
    main()
