"""Environment variables set for one block of code (``temporarily_set``): for the processes a block
starts, which inherit them (an embedded Ray), while the caller's own environment is left as it
was, so a Python API user's later ``ray.init`` sees none of them. Plugin-facing (the import rules
let plugins import it): the vLLM rollout sets its engine's variables around the engine's start, and
the tracker loggers theirs around each tracker call, with this one function."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


@contextmanager
def temporarily_set(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` while the block runs, then each variable as it was (unset again
    if it was unset)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
