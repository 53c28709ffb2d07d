"""Partial rollouts on the long tail: the same separate-mode run with and without
``roles.rollout.partial``, side by side in one invocation.

The ``tiny-longtail-cpu`` preset's responses are mostly 3-5 tokens with a tenth rambling on for
24-48, so nearly every step waits for a few long samples. Without partial rollouts the rollout's
batch runs as long as its longest sample; with them the next step's samples are generated beside
that tail (and weights are swapped mid-generation), so a step's generation carries on where the
previous one paused. Each arm is a whole ``relax run`` of the preset (model built once, cached);
the arms alternate run by run so a slow moment of the machine falls on both, and run r of both
uses ``seed=r``, so the spread of the rewards over runs is the noise they are compared within.

Printed per arm (medians over runs): steady s/step (median over the steps after the first few),
steps per second, the final reward (mean ``reward/mean`` of the last ten steps), the mean
response length and, with partial rollouts, the share of samples that were paused and continued;
then the ratio of steps per second, partial over not.

    python bench/partial_rollout.py                    # 2 runs per arm, 40 steps, max_staleness 1
    python bench/partial_rollout.py --runs 3 --staleness 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relax.testing import tiny_run  # noqa: E402

PRESET = "tiny-longtail-cpu"


def one_run(root: Path, name: str, overrides: list[str], skip: int) -> dict[str, float]:
    """One run of the preset; its steady pace, final reward and shape."""
    started = time.perf_counter()
    code, rows, printed = tiny_run(root, name, "tracing.exporter=none", "trainer.checkpoint_every=0", *overrides,
                                   preset=PRESET)
    wall = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"the {name} run failed (exit {code}):\n{printed[-2000:]}")
    steady = [r["time/step_s"] for r in rows[skip:]]
    tail = rows[-10:]
    return {"s_per_step": statistics.median(steady), "steps_per_s": len(steady) / sum(steady),
            "wall_s": wall, "final_reward": statistics.mean(r["reward/mean"] for r in tail),
            "mean_len": statistics.mean(r["throughput/tokens_per_s"] * r["time/step_s"] for r in rows) / 128,
            "interrupted": statistics.mean(r.get("partial/interrupted_frac", 0.0) for r in rows[skip:]),
            "staleness_max": max(r["staleness/max"] for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="runs per arm")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=4, help="first steps left out of the steady figures")
    parser.add_argument("--staleness", type=int, default=1, help="async_policy.max_staleness of both arms")
    args = parser.parse_args()
    arms = {"without": "roles.rollout.partial=false", "partial": "roles.rollout.partial=true"}
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="relax-partial-bench-") as tmp:
        for run in range(args.runs):
            order = list(arms) if run % 2 == 0 else list(reversed(arms))
            for arm in order:
                got = one_run(Path(tmp), f"{arm}-{run}", [arms[arm], f"trainer.steps={args.steps}", f"seed={run}",
                                                          f"async_policy.max_staleness={args.staleness}"], args.skip)
                results[arm].append(got)
                print(f"  run {run} {arm:8s} {got['s_per_step']:.3f} s/step  {got['steps_per_s']:.2f} steps/s  "
                      f"reward {got['final_reward']:.3f}  wall {got['wall_s']:.0f} s", flush=True)
    print(f"\n{PRESET}, separate mode, max_staleness {args.staleness}, {args.steps} steps, {args.runs} run(s) per arm "
          "(medians over runs)")
    print(f"{'arm':9s} {'s/step':>7s} {'steps/s':>8s} {'reward(last10)':>15s} {'mean len':>9s} {'paused':>7s} "
          f"{'max lag':>8s}")
    medians = {}
    for arm, runs in results.items():
        m = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        medians[arm] = m
        print(f"{arm:9s} {m['s_per_step']:7.3f} {m['steps_per_s']:8.2f} {m['final_reward']:15.3f} "
              f"{m['mean_len']:9.1f} {m['interrupted']:7.3f} {m['staleness_max']:8.0f}")
    ratio = medians["partial"]["steps_per_s"] / medians["without"]["steps_per_s"]
    spread = {arm: ", ".join(f"{r['final_reward']:.3f}" for r in runs) for arm, runs in results.items()}
    print(f"\nsteps/s, partial / without: {ratio:.2f}x;  final reward {medians['partial']['final_reward']:.3f} vs "
          f"{medians['without']['final_reward']:.3f} (per run: {spread['partial']} vs {spread['without']})")


if __name__ == "__main__":
    main()
