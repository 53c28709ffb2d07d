"""``relax report RUN_DIR``: a PNG of reward and step time over the steps of a run."""

from __future__ import annotations

from pathlib import Path

from relax.runtime.metrics import read_metrics


def write_report(run_dir: Path, output: Path | None = None) -> Path:
    """Plot reward/mean and the step-time breakdown from metrics.jsonl; returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no steps yet")
    steps = [r["step"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, [r["reward/mean"] for r in rows], color="tab:green")
    top.set_ylabel("mean reward")
    top.set_title(f"{run_dir.name}: {len(rows)} steps")
    top.grid(alpha=0.3)
    for key, label in (("time/step_s", "step"), ("time/rollout_s", "generate"), ("time/train_s", "train"),
                       ("time/wait_s", "staleness wait"), ("time/weight_sync_s", "weight sync")):
        bottom.plot(steps, [r[key] for r in rows], label=label)
    bottom.set_ylabel("seconds")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    path = output or run_dir / "report.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
