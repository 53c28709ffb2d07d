"""Every algorithm name on the tiny preset, side by side: reward at the start and the end.

    python bench/algorithms.py [--steps 24] [--names grpo,ppo]

Each algorithm trains the same tiny task from the same model and seed (colocate, on-policy), with
the roles it needs (a critic for ppo; a reference when ``--kl`` is given). It prints, per name, the
mean reward of the first 3 and the last 5 steps, the gain, and the mean step time. The reward is
the policy's own (for dapo: over every sample drawn, not only the kept groups).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_runs import run_tiny  # noqa: E402

from relax.spec.algorithms import ALGORITHMS  # noqa: E402
from relax.testing import local_ray  # noqa: E402

NEEDS = {"ppo": ["roles.critic={micro_batch_size: 128}"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--names", default=",".join(sorted(ALGORITHMS)))
    parser.add_argument("--kl", type=float, default=0.0, help="kl_coef (adds roles.reference when > 0)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, local_ray():
        for name in args.names.split(","):
            kl = [f"algorithm.kl_coef={args.kl}", "roles.reference={micro_batch_size: 128}"] if args.kl else []
            extra = [*NEEDS.get(name, []), *kl]
            metrics = run_tiny(name.replace("_", "-"), Path(tmp), [
                f"algorithm.name={name}", f"trainer.steps={args.steps}", "placement.mode=colocate",
                "async_policy.max_staleness=0", "tracing.exporter=none", *extra])
            first = sum(r["reward/mean"] for r in metrics[:3]) / 3
            last = sum(r["reward/mean"] for r in metrics[-5:]) / 5
            step_s = sum(r["time/step_s"] for r in metrics[1:]) / max(1, len(metrics) - 1)
            rows.append((name, first, last, step_s))
            print(f"{name:<22} reward {first:.2f} -> {last:.2f}  ({last - first:+.2f})  {step_s:.2f} s/step", flush=True)
    print("\nalgorithm               first3  last5   gain   s/step")
    for name, first, last, step_s in rows:
        print(f"{name:<22}  {first:5.2f}  {last:5.2f}  {last - first:+5.2f}   {step_s:.2f}")


if __name__ == "__main__":
    main()
