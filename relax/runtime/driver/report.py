"""``relax report RUN_DIR``: a PNG of reward and step time over the steps of a run, and of the
held-out evaluation (``eval.jsonl``) over the policy versions when the run evaluated."""

from __future__ import annotations

from math import nan
from pathlib import Path

from relax.runtime.jsonl_rows import read_rows
from relax.runtime.metrics import EVAL_FILE, read_metrics


def write_report(run_dir: Path, output: Path | None = None) -> Path:
    """Plot reward/mean and the step-time breakdown from metrics.jsonl; returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no steps yet")
    steps = [r["step"] for r in rows]
    evals = eval_rows(run_dir)
    fig, axes = plt.subplots(3 if evals else 2, 1, figsize=(8, 9 if evals else 6), sharex=True)
    top, bottom = axes[0], axes[-1]
    top.plot(steps, [r.get("reward/mean", nan) for r in rows], color="tab:green")
    top.set_ylabel("mean reward")
    top.set_title(f"{run_dir.name}: {len(rows)} steps")
    top.grid(alpha=0.3)
    if evals:  # x: the policy version evaluated (the number of steps trained)
        middle = axes[1]
        versions = [r["eval/version"] for r in evals]
        for key in eval_keys(evals):
            middle.plot(versions, [r.get(key) for r in evals], marker="o", label=key.removeprefix("eval/"))
        middle.set_ylabel("held-out (data.eval)")
        middle.legend(fontsize=8)
        middle.grid(alpha=0.3)
    for key, label in (("time/step_s", "step"), ("time/rollout_s", "generate"), ("time/train_s", "train"),
                       ("time/wait_s", "staleness wait"), ("time/weight_sync_s", "weight sync")):
        bottom.plot(steps, [r.get(key, nan) for r in rows], label=label)  # a row without it: a gap
    bottom.set_ylabel("seconds")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    path = output or run_dir / "report.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def eval_rows(run_dir: Path) -> list[dict]:
    """The run's evaluations (eval.jsonl), one per policy version evaluated, in version order."""
    path = run_dir / EVAL_FILE
    if not path.is_file():
        return []
    newest = {row["eval/version"]: row for row in read_rows(path) if "eval/version" in row}
    return [newest[v] for v in sorted(newest)]


def eval_keys(evals: list[dict]) -> list[str]:
    """What the report shows of each evaluation: the mean reward, pass@1 and the largest pass@k."""
    passes = sorted((k for k in evals[0] if k.startswith("eval/pass@")), key=lambda k: int(k.split("@")[1]))
    return ["eval/reward_mean", *passes[:1], *passes[1:][-1:]]


def eval_table(evals: list[dict]) -> str:
    """The evaluations as text lines, for ``relax report``'s output."""
    keys = eval_keys(evals)
    head = "  ".join(["version", *(k.removeprefix("eval/") for k in keys)])
    lines = [f"{int(r['eval/version']):>7}  " + "  ".join(f"{r[k]:>{len(k) - 5}.3f}" for k in keys) for r in evals]
    return "\n".join([head, *lines])
