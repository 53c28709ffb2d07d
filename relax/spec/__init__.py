"""The typed run spec and its validation (imports pydantic and the standard library only).

``validate_spec`` and ``check_spec`` are loaded on first use: ``relax.registry`` imports this
package's error types, and validation imports the registry, so an eager import here would make
the two depend on which one a process happens to import first.
"""

from typing import Any

from relax.spec.errors import SpecError, SpecIssue
from relax.spec.models import RunSpec

__all__ = ["RunSpec", "SpecError", "SpecIssue", "check_spec", "validate_spec"]


def __getattr__(name: str) -> Any:
    if name in ("validate_spec", "check_spec"):
        from relax.spec import validate

        return getattr(validate, name)
    raise AttributeError(f"module 'relax.spec' has no attribute {name!r}")
