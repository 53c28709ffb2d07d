"""``mlflow``: an MLflow run, in a local store under the output folder unless told otherwise.

With no ``tracking_uri`` (and no ``MLFLOW_TRACKING_URI``) the run goes to the file store
``<output_dir>/mlruns`` (``mlflow ui --backend-store-uri <output_dir>/mlruns`` shows it). MLflow 3
keeps the file store in maintenance mode and refuses it unless ``MLFLOW_ALLOW_FILE_STORE`` is set,
so this logger sets that variable (around its own calls) for the default store only; give ``tracking_uri`` (a server,
or ``sqlite:///...`` with the full ``mlflow`` package) for anything else. ``mlflow-skinny`` is
enough for the file store and for reading it back. MLflow's usage telemetry is off
(``MLFLOW_DISABLE_TELEMETRY``, see ``quiet_env``): the file store makes no network attempt and
writes nothing outside ``mlruns``.

Numbers are metrics at the row's step; strings are tags (their latest value: MLflow tags hold one
value each); the resolved spec is the run's parameters, flattened to ``section.key`` names. Samples
(``trainer.log_samples_every``) are JSON artifacts, ``samples/step-<n>.json``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from relax.contracts import LoggerStatus, RunInfo
from relax.environment import temporarily_set
from relax_plugins.loggers.quiet_env import MLFLOW_QUIET
from relax_plugins.loggers.rows import flatten, split_row

#: Most entries MLflow takes in one ``log_batch`` call (its documented limit is 1000 metrics and 100 params).
_BATCH = 100
#: Longest parameter value MLflow stores; longer ones are cut (and end in "...").
_PARAM_CHARS = 6000
_STATUS = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}


class MlflowLogger:
    """Every metrics row into an MLflow run (a local file store by default)."""

    class Config(BaseModel):
        """Options of the MLflow logger."""

        model_config = ConfigDict(extra="forbid")

        tracking_uri: str | None = None
        """Where runs are stored: a server URL, ``file:`` or ``sqlite:`` URI; null:
        ``MLFLOW_TRACKING_URI`` when it is set, else ``<output_dir>/mlruns``."""
        experiment: str = "relax"
        """The MLflow experiment (created when it does not exist)."""
        run_name: str | None = None
        """The MLflow run's name (default: the spec's ``name``)."""
        tags: dict[str, str] = Field(default_factory=dict)
        """Tags set on the MLflow run."""

    def __init__(self, config: Config, run: RunInfo) -> None:
        try:
            with temporarily_set(MLFLOW_QUIET):  # MLflow sets up its telemetry when first imported
                from mlflow import MlflowClient
                from mlflow.entities import Param, RunTag
        except ImportError as exc:
            raise ImportError("the mlflow logger needs mlflow (or mlflow-skinny): "
                              "pip install 'relax-rl[trackers]'") from exc
        uri = config.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        self.env = dict(MLFLOW_QUIET)  # no telemetry: no network attempt, no ~/.config/mlflow file
        if uri is None:
            uri = (Path(run.output_dir) / "mlruns").resolve().as_uri()
            self.env["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 refuses file stores otherwise
        self.tracking_uri = uri
        with temporarily_set(self.env):
            self.client: Any = MlflowClient(tracking_uri=uri)
            found = self.client.get_experiment_by_name(config.experiment)
            experiment_id = (found.experiment_id if found is not None
                             else self.client.create_experiment(config.experiment))
            created = self.client.create_run(experiment_id, run_name=config.run_name or run.name, tags=config.tags)
            self.run_id: str = created.info.run_id
            params = [Param(k, v if len(v) <= _PARAM_CHARS else v[:_PARAM_CHARS - 3] + "...")
                      for k, v in flatten(run.config).items()]
            for i in range(0, len(params), _BATCH):
                self.client.log_batch(self.run_id, params=params[i:i + _BATCH])
            self.client.log_batch(self.run_id, tags=[RunTag("relax.start_step", str(run.start_step))])

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric, RunTag

        scalars, texts = split_row(metrics)
        now = int(time.time() * 1000)
        entries = [Metric(k, v, now, step) for k, v in scalars.items()]
        tags = [RunTag(k, v) for k, v in texts.items()]
        with temporarily_set(self.env):
            for i in range(0, max(len(entries), 1), _BATCH):
                self.client.log_batch(self.run_id, metrics=entries[i:i + _BATCH], tags=tags if i == 0 else [])

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A sampled step's rows as the artifact ``samples/step-<step>.json`` (``{"step", "rows"}``)."""
        with temporarily_set(self.env):
            self.client.log_dict(self.run_id, {"step": step, "rows": rows}, f"samples/step-{step}.json")

    def close(self, status: LoggerStatus) -> None:
        with temporarily_set(self.env):
            self.client.set_terminated(self.run_id, status=_STATUS[status])
