"""``wandb``: a Weights & Biases run, offline unless asked otherwise.

Offline is the default because a training run must not depend on the network or on an account:
unless the options or ``WANDB_MODE`` say ``online``, the run is written to
``<output_dir>/wandb/offline-run-*`` and nothing is sent; ``wandb sync <that folder>`` uploads it
later. With ``mode: online`` (and ``WANDB_API_KEY`` or ``wandb login``) it streams as usual.

Every row is logged with its ``step`` as the x-axis (``define_metric("*", step_metric="step")``,
so rows a resumed run writes again for the same steps are kept, not refused as out of order);
strings are logged as they are (wandb keeps them in the run's history). The resolved spec is the
run's config. wandb's console capture is off: the run's own progress lines stay as they are.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from relax.contracts import LoggerStatus, RunInfo
from relax_plugins.loggers.rows import split_row


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
        self.run: Any = wandb.init(
            project=config.project, entity=config.entity, name=config.name or run.name, dir=str(self.dir),
            mode=self.mode, group=config.group, tags=config.tags or None, notes=config.notes,
            config=run.config, reinit="create_new",
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        scalars, texts = split_row(metrics)
        self.run.log({**scalars, **texts, "step": step})

    def close(self, status: LoggerStatus) -> None:
        import wandb

        self.run.finish(exit_code=0 if status == "finished" else 1)
        # finish returns before wandb's service has written the run file out; stopping the service
        # waits for it, so the folder is complete (for wandb sync, or a reader) once close returns.
        wandb.teardown()
