"""``wandb``: a Weights & Biases run, offline unless asked otherwise.

Offline is the default because a training run must not depend on the network or on an account:
unless the options or ``WANDB_MODE`` say ``online``, the run is written to
``<output_dir>/wandb/offline-run-*`` and nothing is sent; ``wandb sync <that folder>`` uploads it
later. With ``mode: online`` (and ``WANDB_API_KEY`` or ``wandb login``) it streams as usual.
Offline it makes no network attempt and writes only under that folder: wandb's error reporting,
system metrics, machine and git probes are off, and its cache, config and data folders are
``<dir>/wandb/{cache,config,data,artifacts}`` (``quiet_env``; error reporting is off online too).

Every row is logged with its ``step`` as the x-axis (``define_metric("*", step_metric="step")``,
so rows a resumed run writes again for the same steps are kept, not refused as out of order);
strings are logged as they are (wandb keeps them in the run's history). The resolved spec is the
run's config. Samples (``trainer.log_samples_every``) are the table ``samples``, logged at their
step (offline, its data is under ``files/media/table/``). wandb's console capture is off: the run's own progress lines
stay as they are.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from relax.contracts import LoggerStatus, RunInfo
from relax.environment import temporarily_set
from relax_plugins.loggers.quiet_env import WANDB_QUIET, wandb_folders
from relax_plugins.loggers.rows import sample_table, split_row


def wandb_mode(option: str | None) -> str:
    """The mode a run uses: the option if given, else ``WANDB_MODE`` if set, else offline."""
    return option or os.environ.get("WANDB_MODE") or "offline"


class WandbLogger:
    """Every metrics row into a wandb run (offline by default)."""

    class Config(BaseModel):
        """Options of the wandb logger."""

        model_config = ConfigDict(extra="forbid")

        project: str = "relax"
        """The wandb project."""
        entity: str | None = None
        """The wandb team or user (default: the account's own)."""
        name: str | None = None
        """The wandb run's display name (default: the spec's ``name``)."""
        mode: Literal["offline", "online", "disabled"] | None = None
        """offline (written locally, ``wandb sync`` uploads it), online, or disabled; null:
        ``WANDB_MODE`` when it is set, else offline."""
        dir: str | None = None
        """Folder the ``wandb/`` run folder goes in; default and relative ones are taken from the
        run's output folder."""
        group: str | None = None
        """A wandb group to put the run in."""
        tags: list[str] = Field(default_factory=list)
        """Tags of the wandb run."""
        notes: str | None = None
        """Notes of the wandb run."""

    def __init__(self, config: Config, run: RunInfo) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError("the wandb logger needs the wandb package: pip install 'relax-rl[trackers]'") from exc
        folder = Path(config.dir or ".")
        self.dir = folder if folder.is_absolute() else Path(run.output_dir) / folder
        self.dir.mkdir(parents=True, exist_ok=True)
        self.mode = wandb_mode(config.mode)
        offline = self.mode != "online"
        # No error reporting from wandb's service, and offline, wandb's own folders in the run's
        # (quiet_env): an offline run makes no network attempt and writes nothing outside it.
        self.env = {**WANDB_QUIET, **(wandb_folders(self.dir / "wandb") if offline else {})}
        # Offline, nothing probes the machine either: no system-metrics process, no machine or git
        # metadata (an online run keeps them, as wandb's users expect).
        quiet = {"x_disable_stats": True, "x_disable_meta": True, "x_disable_machine_info": True,
                 "disable_git": True, "disable_job_creation": True} if offline else {}
        with temporarily_set(self.env):
            self.run: Any = wandb.init(
                project=config.project, entity=config.entity, name=config.name or run.name, dir=str(self.dir),
                mode=self.mode, group=config.group, tags=config.tags or None, notes=config.notes,
                config=run.config, reinit="create_new",
                settings=wandb.Settings(console="off", silent=True, **quiet),
            )
            self.run.define_metric("step")
            self.run.define_metric("*", step_metric="step")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        scalars, texts = split_row(metrics)
        with temporarily_set(self.env):
            self.run.log({**scalars, **texts, "step": step})

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A sampled step's rows as the table ``samples`` (one row per sample) at ``step``."""
        import wandb

        columns, data = sample_table(rows)
        with temporarily_set(self.env):
            self.run.log({"samples": wandb.Table(columns=columns, data=data), "step": step})

    def close(self, status: LoggerStatus) -> None:
        import wandb

        with temporarily_set(self.env):
            self.run.finish(exit_code=0 if status == "finished" else 1)
            # finish returns before wandb's service has written the run file out; stopping the
            # service waits for it, so the folder is complete (for wandb sync, or a reader) once
            # close returns.
            wandb.teardown()
