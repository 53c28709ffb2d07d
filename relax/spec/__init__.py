"""The typed run spec and its validation (imports pydantic and the standard library only)."""

from relax.spec.errors import SpecError, SpecIssue
from relax.spec.models import RunSpec
from relax.spec.validate import check_spec, validate_spec

__all__ = ["RunSpec", "SpecError", "SpecIssue", "check_spec", "validate_spec"]
