"""How much faster is asynchronous (separate, max_staleness 1) than colocated training?

    python bench/async_speedup.py [--steps 30] [--skip 5] [key=value ...]

Runs the tiny CPU preset twice in one go, on one embedded Ray: colocate (on-policy, one process
alternates generating and training) and separate with max_staleness 1 (the rollout generates the
next batch while the actor trains). It prints the steady-state steps/s of each (the first --skip
steps are left out: model loading and warm-up), their ratio, and the ideal ratio (R + T) / max(R, T)
from the colocated run's median rollout time R and train time T: what perfect overlap with zero
overhead would give. The Relax paper reports 1.76x-2.00x on GPUs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tiny_runs import run_tiny  # noqa: E402


def run(mode: str, staleness: int, steps: int, root: Path, extra: list[str]) -> list[dict]:
    return run_tiny(f"{mode}-k{staleness}", root, [f"trainer.steps={steps}", f"placement.mode={mode}",
                                                   f"async_policy.max_staleness={staleness}",
                                                   "tracing.exporter=none", *extra])


def steady(rows: list[dict], skip: int) -> list[dict]:
    return rows[skip:] if len(rows) > skip + 2 else rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        colocate = steady(run("colocate", 0, args.steps, Path(tmp), args.overrides), args.skip)
        separate = steady(run("separate", 1, args.steps, Path(tmp), args.overrides), args.skip)
    ray.shutdown()

    def steps_per_s(rows: list[dict]) -> float:
        return len(rows) / sum(r["time/step_s"] for r in rows)

    rollout = statistics.median(r["time/rollout_s"] for r in colocate)
    train = statistics.median(r["time/train_s"] for r in colocate)
    ideal = (rollout + train) / max(rollout, train)
    c, s = steps_per_s(colocate), steps_per_s(separate)
    print(f"colocate (max_staleness 0): {c:.2f} steps/s  "
          f"(work share {statistics.median(r['time/work_frac'] for r in colocate):.2f})")
    print(f"separate (max_staleness 1): {s:.2f} steps/s  "
          f"(work share {statistics.median(r['time/work_frac'] for r in separate):.2f}, "
          f"mean staleness {statistics.mean(r['staleness/mean'] for r in separate):.2f})")
    print(f"speedup separate/colocate: {s / c:.2f}x   ideal (R+T)/max(R,T) with R={rollout:.3f}s, "
          f"T={train:.3f}s: {ideal:.2f}x")


if __name__ == "__main__":
    main()
