"""The environment the tracker libraries run under: no telemetry, no phoning home, and (for an
offline wandb run) every file they keep under the run's folder.

wandb and MLflow read these settings from environment variables, some of them in processes of
their own (wandb's ``wandb-core`` service, started by ``wandb.init``, inherits the environment of
that moment), so each logger sets them around its own calls only and restores them after (with
``relax.environment.temporarily_set``); the driver's other code and the workers never see them. What each one does,
read from the installed sources (wandb 0.31, mlflow-skinny 3.17):

- ``WANDB_ERROR_REPORTING=false``: wandb starts ``wandb-core`` with ``--no-observability``
  (``wandb/sdk/lib/service/service_process.py``); without it the service looked up its error
  reporting host at start-up, even offline.
- ``WANDB_CACHE_DIR``, ``WANDB_CONFIG_DIR``, ``WANDB_DATA_DIR``, ``WANDB_ARTIFACT_DIR`` (offline
  only): ``wandb-core`` writes its debug logs to ``$WANDB_CACHE_DIR/wandb/logs`` (else
  ``~/.cache/wandb/logs``), and tables and artifacts are staged under the data and artifact
  folders. An online run keeps the user's folders (their login and settings live there).
- ``MLFLOW_DISABLE_TELEMETRY=true``: MLflow creates its telemetry client at ``import mlflow``
  (writing an installation id to ``~/.config/mlflow/telemetry.json``) and fetches its telemetry
  config over the network on the first tracked call; both check this variable
  (``mlflow/telemetry/utils.py``). ``DO_NOT_TRACK`` is honoured by MLflow only as ``true``, so
  the MLflow variable is the one set.
- ``MLFLOW_ALLOW_FILE_STORE=true`` for the default file store, which MLflow 3 refuses otherwise.
"""

from __future__ import annotations

from pathlib import Path

#: wandb: no error reporting from its service (``wandb.env.ERROR_REPORTING``).
WANDB_QUIET = {"WANDB_ERROR_REPORTING": "false"}
#: MLflow: no usage telemetry, no installation id file (``mlflow.environment_variables``).
MLFLOW_QUIET = {"MLFLOW_DISABLE_TELEMETRY": "true"}


def wandb_folders(root: Path) -> dict[str, str]:
    """wandb's own folders (cache, config, data, artifacts) under ``root`` (an offline run's
    ``wandb/`` folder in the run's output folder)."""
    return {"WANDB_CACHE_DIR": str(root / "cache"), "WANDB_CONFIG_DIR": str(root / "config"),
            "WANDB_DATA_DIR": str(root / "data"), "WANDB_ARTIFACT_DIR": str(root / "artifacts")}
