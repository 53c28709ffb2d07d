"""Relax: asynchronous RL post-training on Ray.

The Python API (docs/python-api.md): ``relax.validate(spec)``, ``relax.plan(spec)`` and
``relax.run(spec)``, the commands of the same names for notebooks and scripts. They are loaded on
first use, so ``import relax`` stays as light as the interpreter (no pydantic, torch or ray).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "plan", "run", "validate"]


def __getattr__(name: str) -> Any:
    # Module attributes looked up on first use (PEP 562). ``relax.plan`` is the package of that
    # name, made callable (``relax.plan(spec)``) in its own ``__init__``.
    if name in ("run", "validate"):
        from relax import api

        return getattr(api, name)
    if name == "plan":
        import importlib

        return importlib.import_module("relax.plan")
    raise AttributeError(f"module 'relax' has no attribute {name!r}")
