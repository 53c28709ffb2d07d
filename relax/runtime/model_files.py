"""The run's model as a local folder: the driver materializes it once before any worker starts
(``relax run``), and a worker's model-based reward materializes its judge the same way.

Shared by the driver and the workers, so it sits beside them rather than in either room.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from relax.contracts import PluginKind
from relax.registry import get_registry
from relax.spec.architecture import BUILTIN_PREFIX
from relax.spec.hf_cache import cached_snapshot
from relax.spec.models import RunSpec

CACHE_ENV = "RELAX_CACHE"


def cache_dir() -> str:
    """Where built-in models are built once and kept (``$RELAX_CACHE``, default ``~/.cache/relax``)."""
    return os.environ.get(CACHE_ENV) or str(Path.home() / ".cache" / "relax")


def materialize_model(spec: RunSpec, base_dir: Path) -> str:
    """A local folder for ``model.path``; ``builtin:<name>`` is built by its plugin (cached)."""
    return materialize_path(spec.model.path, spec.model.options, base_dir)


def materialize_path(path: str, options: dict[str, Any], base_dir: Path) -> str:
    """A local folder for a model named like ``model.path`` (with ``model.options``): a relative
    folder is taken from ``base_dir``, ``builtin:<name>`` is built by its plugin (cached)."""
    if path.startswith(BUILTIN_PREFIX):
        name, registry = path[len(BUILTIN_PREFIX):], get_registry()
        model = registry.load(PluginKind.models, name)(registry.build_config(PluginKind.models, name, options))
        return model.materialize(cache_dir())
    folder = Path(path).expanduser()
    folder = folder if folder.is_absolute() else base_dir / folder
    if folder.is_dir():
        return str(folder)
    # A hub id in this machine's Hugging Face cache: its snapshot folder, so that no backend asks the
    # hub for anything (transformers would check for a newer revision unless HF_HUB_OFFLINE is set)
    # and the Megatron trainer, which reads a folder, takes a hub id too. On a cluster every node
    # must then hold that folder at the same path (docs/cluster.md).
    snapshot = cached_snapshot(path)
    return str(snapshot) if snapshot is not None else path
