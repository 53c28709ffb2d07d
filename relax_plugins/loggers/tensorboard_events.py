"""``tensorboard``: TensorBoard event files under the run's output folder.

Writes with ``torch.utils.tensorboard.SummaryWriter``: it needs only the ``tensorboard`` package
(``pip install 'relax-rl[trackers]'``; no TensorFlow, no Pillow for scalars and text) and, unlike
``tensorboard.summary.Writer``, also writes text. Every numeric key of a row is a scalar of the
same name at the row's step; string values (``data/order``, ``samples/trained_hash``) are text
summaries, and the resolved spec is the text ``config`` at step 0. Samples
(``trainer.log_samples_every``) are the text ``samples`` at their step, in Markdown. View with
``tensorboard --logdir <output_dir>/tensorboard``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from relax.contracts import LoggerStatus, RunInfo
from relax_plugins.loggers.rows import samples_markdown, split_row


class TensorBoardLogger:
    """Every metrics row as TensorBoard scalars (numbers) and text (strings)."""

    class Config(BaseModel):
        """Options of the TensorBoard logger."""

        model_config = ConfigDict(extra="forbid")

        log_dir: str = "tensorboard"
        """Folder of the event files; a relative one is taken from the run's output folder."""
        flush_secs: int = Field(10, ge=1)
        """Longest time a written value waits in memory before it reaches the event file."""
        text: bool = True
        """Write string values, the run's spec and the samples (``samples`` text, Markdown, at each
        sampled step) as text summaries (false: numbers only)."""

    def __init__(self, config: Config, run: RunInfo) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # torch's writer imports the tensorboard package
            raise ImportError("the tensorboard logger needs the tensorboard package: "
                              "pip install 'relax-rl[trackers]'") from exc
        folder = Path(config.log_dir)
        self.log_dir = folder if folder.is_absolute() else Path(run.output_dir) / folder
        self.text = config.text
        self.writer: Any = SummaryWriter(log_dir=str(self.log_dir), flush_secs=config.flush_secs)
        if self.text:
            spec = json.dumps(run.config, indent=2, sort_keys=True, default=str)
            self.writer.add_text("config", f"```\n{spec}\n```", 0)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        scalars, texts = split_row(metrics)
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        if self.text:
            for key, value in texts.items():
                self.writer.add_text(key, value, step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A sampled step's rows as the text summary ``samples`` (Markdown) at ``step``."""
        if self.text:
            self.writer.add_text("samples", samples_markdown(step, rows), step)

    def close(self, status: LoggerStatus) -> None:
        self.writer.flush()
        self.writer.close()
