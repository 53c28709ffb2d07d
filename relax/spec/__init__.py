"""The typed run spec and its validation (imports pydantic and the standard library only).

The error types live in ``relax.errors`` (every layer that reports a spec's problems raises them);
they are named here too, as the spec's public API (``relax.spec.SpecError``).
"""

from relax.errors import SpecError, SpecIssue
from relax.spec.models import RunSpec
from relax.spec.validate import check_spec, validate_spec

__all__ = ["RunSpec", "SpecError", "SpecIssue", "check_spec", "validate_spec"]
