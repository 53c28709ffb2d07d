"""How many steps a run takes: ``trainer.steps``, or ``trainer.epochs`` passes over the training
data (``ceil(epochs * size / algorithm.prompts_per_step)``), with the training set's size known
before anything is built.

The size comes from the data itself, read cheaply (no torch, no ``datasets``): a data file's rows
are counted (``relax.spec.data_files.data_rows``, then its ``limit`` option), and a ``relax.datasets``
plugin says its own through an optional classmethod ``length(config) -> int`` (the built-in
synthetic sets: their ``size`` option). A plugin that does not say cannot be trained for epochs.
"""

from __future__ import annotations

import math
from pathlib import Path

from relax.contracts import PluginKind
from relax.errors import SpecError, SpecIssue
from relax.registry import PluginError, Registry, get_registry
from relax.spec.data_files import data_path, data_rows, dataset_plugin, missing_data_issue
from relax.spec.models import RunSpec


def training_set_size(spec: RunSpec, base_dir: Path, registry: Registry | None = None) -> tuple[int | None, str]:
    """The number of prompts of ``data.train``, or None and why it cannot be known here."""
    source = spec.data.train
    name, implied = dataset_plugin(source.source)
    options = {**implied, **source.options}
    if "path" in implied:
        resolved = data_path(str(options["path"]), base_dir)
        missing = missing_data_issue(source.source, resolved, "data.train.source")
        if missing is not None:
            return None, missing.message
        rows = data_rows(resolved, str(options.get("split", "train")))
        if rows is None:
            return None, f"the rows of {resolved} cannot be counted (it is not readable as {name} data)"
        limit = options.get("limit")
        return (min(rows, int(limit)) if isinstance(limit, int) and limit > 0 else rows), ""
    registry = registry or get_registry()
    try:
        cls = registry.load(PluginKind.datasets, name)
        config = registry.build_config(PluginKind.datasets, name, source.options)
    except (PluginError, ValueError) as exc:
        return None, f"data set '{name}' cannot be loaded here ({str(exc).splitlines()[0]})"
    length = getattr(cls, "length", None)
    if not callable(length):
        return None, (f"data set '{name}' does not say its size before it is built (its plugin has no "
                      "length(config) classmethod)")
    return int(length(config)), ""


def steps_for_epochs(epochs: float, size: int, prompts_per_step: int) -> int:
    """``ceil(epochs * size / prompts_per_step)``, at least 1: the steps that take ``epochs``
    passes over ``size`` prompts, ``prompts_per_step`` a step (the last one may reach into the
    next pass, as ``relax.runtime.worker.data.PromptSchedule`` crosses epochs)."""
    # Round off below one part in 10^9 first, so 1.0 epoch of 64 prompts at 16 a step is 4, not 5.
    return max(1, math.ceil(round(epochs * size / prompts_per_step, 9)))


def run_steps(spec: RunSpec, base_dir: Path | None = None, registry: Registry | None = None) -> int:
    """The run's training steps: ``trainer.steps``, or those ``trainer.epochs`` resolve to. Raises
    ``SpecError`` when epochs are given and the training set's size cannot be known here."""
    trainer = spec.trainer
    if trainer.steps is not None:
        return trainer.steps
    assert trainer.epochs is not None  # TrainerSpec refuses neither
    size, why = training_set_size(spec, base_dir or Path.cwd(), registry)
    if size is None:
        raise SpecError([epochs_issue(trainer.epochs, why)])
    if size < 1:
        raise SpecError([SpecIssue("trainer.epochs", f"the training data ({spec.data.train.source}) has no rows",
                                   "give data.train at least one prompt")])
    return steps_for_epochs(trainer.epochs, size, spec.algorithm.prompts_per_step)


def epochs_issue(epochs: float, why: str) -> SpecIssue:
    """The issue of ``trainer.epochs`` whose training-set size is unknown."""
    return SpecIssue("trainer.epochs", f"trainer.epochs={epochs:g} needs the training set's size, but {why}",
                     "give trainer.steps instead, or use a data file or a data set that declares its size")
