"""A spec as the Python API takes it, loaded and checked: a YAML/JSON path or a preset name with
dotted overrides, a mapping (a spec file's content), or a ``RunSpec`` already validated.

Here, in the planner, rather than in ``relax.api``: the package ``relax.plan`` is itself the API's
``relax.plan(spec)`` (a package's name on ``relax`` is the package once it is imported), so it
needs this, and ``relax.api`` imports it from here. The arrow goes one way, api to plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from relax.spec.models import RunSpec


def checked_spec(spec: Any, overrides: Sequence[str], base_dir: str | Path | None,
                 runnable: bool, here: bool = True) -> tuple[RunSpec, Path]:
    """The validated spec and the folder its relative paths are taken from (``SpecError`` with
    every problem, as ``relax validate`` prints them, when it is not valid); ``runnable`` and
    ``here`` as for ``validate_spec``."""
    from relax.spec import check_spec, validate_spec

    if isinstance(overrides, str):
        raise TypeError("overrides is a list of dotted overrides, e.g. ['trainer.steps=5'], not one string")
    if isinstance(spec, RunSpec):
        if overrides:
            raise ValueError("overrides apply to a spec file, a preset name or a mapping; a RunSpec is already "
                             "resolved: pass its file or preset with the overrides instead")
        folder = Path(base_dir) if base_dir is not None else Path.cwd()
        return check_spec(spec, base_dir=folder, runnable=runnable, here=here), folder
    if isinstance(spec, Mapping):
        if overrides:
            raise ValueError("overrides apply to a spec file or a preset name; change the mapping itself instead")
        folder = Path(base_dir) if base_dir is not None else Path.cwd()
        return validate_spec(dict(spec), base_dir=folder, runnable=runnable, here=here), folder
    if isinstance(spec, (str, Path)):
        from relax.config import load_spec
        from relax.config.redaction import attach

        loaded = load_spec(str(spec), list(overrides))
        checked = validate_spec(loaded.raw, base_dir=loaded.base_dir, runnable=runnable, here=here)
        return attach(checked, loaded.redactions), loaded.base_dir
    raise TypeError(f"a spec is a path, a preset name, a mapping or a RunSpec, not {type(spec).__name__}")
