"""Building a built-in model once per recipe and machine: a cached folder keyed by a fingerprint.

A built-in model (``builtin:tiny-lm``, ``builtin:tiny-omni``) is built locally from its config and
its recipe's source; the fingerprint hashes both, so editing either rebuilds it once. The build
happens in a staging folder under an inter-process lock and is renamed into place with a marker
written last: several processes asking at once build it once, and a crash never leaves a folder
that looks finished. Standard library only (the builders import torch themselves).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

#: Marker written last into a finished build; a folder without it is not a usable model.
BUILD_MARKER = "relax-build.json"


def recipe_fingerprint(config: dict[str, Any], recipe_files: Iterable[Path]) -> str:
    """A short hash of a model's config and of its recipe files' text."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for path in recipe_files:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


def cached_build(cache_dir: str, name: str, fingerprint: str, config: dict[str, Any],
                 build: Callable[[Path], dict[str, Any]]) -> str:
    """The folder ``<cache_dir>/<name>-<fingerprint>``, built by ``build(staging) -> report``
    first unless a finished one is there."""
    cache = Path(cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    folder = cache / f"{name}-{fingerprint}"
    if (folder / BUILD_MARKER).is_file():
        return str(folder)
    with exclusive(cache / f"{folder.name}.lock"):
        if (folder / BUILD_MARKER).is_file():  # another process built it while we waited
            return str(folder)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=cache))
        try:
            report = build(staging)
            (staging / BUILD_MARKER).write_text(json.dumps(
                {"fingerprint": fingerprint, "config": config, **report}, indent=2))
            if folder.exists():  # a stale, unfinished folder (no marker) from a crash
                shutil.rmtree(folder)
            os.replace(staging, folder)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return str(folder)


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """An inter-process lock held while building (``fcntl.flock``; released if the process dies)."""
    import fcntl

    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
