"""Held-out evaluation during training: the same separate-mode run with and without ``data.eval``,
side by side in one invocation.

In separate mode the evaluation runs in a worker of its own (``trainer.eval.host: auto``), which
loads each due version from the object store and, on CPU, takes only the CPU time the rollout and
the actor leave idle (``relax.runtime.worker.evaluation``), so it should cost the training little: the
issue asks for training steps per second within 10% of the run without it. ``--host rollout``
measures the other way, the rollout evaluating right after it produced a step. Each arm is a whole
``relax run`` of the ``tiny-cpu`` preset (separate mode, max_staleness 1); the evaluating arm scores ``--prompts``
held-out arithmetic problems (``synthetic:arithmetic`` with another seed) x ``--samples`` responses
before training, every ``--every`` steps and after the last step. The arms alternate run by run
(a slow moment of the machine falls on both) and run r of both uses ``seed=r``.

Printed per arm (medians over runs): training steps per second (all steps after the first
``--skip``, the steps an evaluation ran beside included), the final reward, and for the evaluating
arm the evaluations and their mean seconds; then the ratio of training steps per second, with
evaluation over without: the median of the run pairs' ratios (each pair ran back to back, so a
machine that speeds up or slows down over the bench moves both of its runs), and the ratio of the
arms' medians.

    python bench/eval_overhead.py                     # 2 runs per arm, 60 steps, eval every 10
    python bench/eval_overhead.py --runs 3 --prompts 128
    python bench/eval_overhead.py --host rollout      # the rollout evaluates between its steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relax.testing import tiny_run  # noqa: E402


def one_run(root: Path, name: str, overrides: list[str], skip: int) -> dict[str, float]:
    started = time.perf_counter()
    code, rows, printed = tiny_run(root, name, "tracing.exporter=none", "trainer.checkpoint_every=0", *overrides)
    wall = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"the {name} run failed (exit {code}):\n{printed[-2000:]}")
    steady = [r["time/step_s"] for r in rows[skip:]]
    evals_path = root / name / "eval.jsonl"
    evals = [json.loads(line) for line in evals_path.read_text().splitlines()] if evals_path.exists() else []
    return {"steps_per_s": len(steady) / sum(steady), "wall_s": wall,
            "final_reward": statistics.mean(r["reward/mean"] for r in rows[-10:]),
            "evals": float(len(evals)), "eval_s": statistics.mean(e["eval/seconds"] for e in evals) if evals else 0.0,
            "final_pass1": evals[-1]["eval/pass@1"] if evals else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="runs per arm")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10, help="trainer.eval_every")
    parser.add_argument("--prompts", type=int, default=64, help="held-out prompts")
    parser.add_argument("--samples", type=int, default=4, help="trainer.eval.samples_per_prompt")
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the steady figures")
    parser.add_argument("--host", choices=("auto", "own", "rollout"), default="auto", help="trainer.eval.host")
    args = parser.parse_args()
    evaluation = [f"data.eval={{source: 'synthetic:arithmetic', options: {{size: {args.prompts}, seed: 12345}}}}",
                  f"trainer.eval_every={args.every}", f"trainer.eval.samples_per_prompt={args.samples}",
                  f"trainer.eval.host={args.host}"]
    arms = {"without": [], "eval": evaluation}
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="relax-eval-bench-") as tmp:
        for run in range(args.runs):
            for arm in (list(arms) if run % 2 == 0 else list(reversed(arms))):
                got = one_run(Path(tmp), f"{arm}-{run}", [*arms[arm], f"trainer.steps={args.steps}", f"seed={run}"],
                              args.skip)
                results[arm].append(got)
                print(f"  run {run} {arm:8s} {got['steps_per_s']:.2f} steps/s  reward {got['final_reward']:.3f}  "
                      f"evals {got['evals']:.0f} ({got['eval_s']:.2f} s each)  wall {got['wall_s']:.0f} s", flush=True)
    print(f"\ntiny-cpu, separate mode, {args.steps} steps; eval arm: {args.prompts} held-out prompts x {args.samples} "
          f"samples every {args.every} steps, trainer.eval.host {args.host}; {args.runs} run(s) per arm (medians over runs)")
    print(f"{'arm':9s} {'steps/s':>8s} {'reward(last10)':>15s} {'evals':>6s} {'s/eval':>7s} {'pass@1 final':>13s}")
    medians = {}
    for arm, runs in results.items():
        m = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        medians[arm] = m
        print(f"{arm:9s} {m['steps_per_s']:8.2f} {m['final_reward']:15.3f} {m['evals']:6.0f} {m['eval_s']:7.2f} "
              f"{m['final_pass1']:13.3f}")
    ratio = medians["eval"]["steps_per_s"] / medians["without"]["steps_per_s"]
    pairs = [e["steps_per_s"] / w["steps_per_s"] for e, w in zip(results["eval"], results["without"])]
    print(f"\ntraining steps/s, with evaluation / without: {statistics.median(pairs):.2f}x, the median over run "
          f"pairs ({', '.join(f'{p:.2f}' for p in pairs)}); {ratio:.2f}x of the arms' medians. "
          "The issue's bound: within 10% (>= 0.90x)")


if __name__ == "__main__":
    main()
