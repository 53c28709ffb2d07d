"""Field docstrings read on demand (``relax.spec.attribute_docs``) give the descriptions and JSON
Schemas that pydantic's ``use_attribute_docstrings`` gives at class creation."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from relax.spec.attribute_docs import DocumentedModel, document


def _family(base: type[BaseModel], config: ConfigDict) -> dict[str, type[BaseModel]]:
    """The same three models on either base: nesting (plain, optional, list, mapping), an explicit
    description, inheritance and a field declared again without a docstring."""

    class Inner(base):
        """A nested section."""

        model_config = config

        a: int = 1
        """Inner a: with
        two lines."""
        b: str = Field("x", description="explicit")
        """An explicit description wins over this docstring."""
        c: bool = False

    class Parent(base):
        """The outer section."""

        model_config = config

        inner: Inner = Field(default_factory=Inner)
        """The inner one."""
        items: list[Inner] = []
        """Several."""
        maybe: Inner | None = None
        by_key: dict[str, Inner] = {}
        """A mapping of them."""
        plain: int = 0
        """Declared here, inherited below."""

        def method(self) -> None:
            """Not a field."""

    class Child(Parent):
        extra: float = 0.5
        """The child's own."""
        plain: int = 1

    return {"Inner": Inner, "Parent": Parent, "Child": Child}


def _descriptions(model: type[BaseModel]) -> dict[str, Any]:
    return {name: field.description for name, field in model.model_fields.items()}


def test_same_descriptions_and_schemas_as_pydantic():
    reference = _family(BaseModel, ConfigDict(extra="forbid", use_attribute_docstrings=True))
    lazy = _family(DocumentedModel, ConfigDict(extra="forbid"))
    assert lazy["Parent"].model_fields["inner"].description is None  # nothing read at class creation
    for name in ("Child", "Parent", "Inner"):  # the child first: it documents the models it holds
        assert lazy[name].model_json_schema() == reference[name].model_json_schema(), name
        assert _descriptions(lazy[name]) == _descriptions(reference[name]), name
    assert _descriptions(lazy["Child"])["plain"] is None  # declared again without a docstring
    assert _descriptions(lazy["Child"])["inner"] == "The inner one."


def test_document_on_a_plain_pydantic_model():
    """A plugin ``Config`` is a plain ``BaseModel``: ``document`` gives it its docstrings, and
    leaves one that reads them itself (``use_attribute_docstrings``) as it is."""
    lazy = _family(BaseModel, ConfigDict())
    reference = _family(BaseModel, ConfigDict(use_attribute_docstrings=True))
    assert document(lazy["Parent"]) is lazy["Parent"]
    assert lazy["Parent"].model_json_schema() == reference["Parent"].model_json_schema()
    before = {name: _descriptions(model) for name, model in reference.items()}
    document(reference["Child"])
    assert {name: _descriptions(model) for name, model in reference.items()} == before


def test_validation_unchanged_after_documenting():
    lazy = _family(DocumentedModel, ConfigDict(extra="forbid"))
    before = lazy["Child"].model_validate({"items": [{"a": 2}], "extra": 1.5}).model_dump()
    document(lazy["Child"])
    assert lazy["Child"].model_validate({"items": [{"a": 2}], "extra": 1.5}).model_dump() == before


def test_spec_models_read_no_docstring_at_import():
    """Importing the spec models reads no source; the spec's JSON Schema still has every description."""
    code = ("import relax.spec.models as m, linecache\n"
            "assert m.ModelSpec.model_fields['path'].description is None\n"
            "assert not any(name.endswith('spec/models.py') for name in linecache.cache), 'source read'\n"
            "schema = m.RunSpec.model_json_schema()\n"
            "assert schema['$defs']['ModelSpec']['properties']['path']['description'].startswith('A local')\n")
    _passes_in_a_fresh_interpreter(code)


def test_validate_reads_no_source():
    """``relax validate`` on the tiny preset reads no model's or plugin's source for docstrings
    (a model or plugin Config back on ``use_attribute_docstrings`` would, at every validation)."""
    code = ("import linecache\n"
            "from relax.cli import main\n"
            "assert main(['validate', 'tiny-cpu']) == 0\n"
            "read = [name for name in linecache.cache if 'relax' in name]\n"
            "assert not read, read\n")
    _passes_in_a_fresh_interpreter(code)


def _passes_in_a_fresh_interpreter(code: str) -> None:
    """Run ``code`` in a new Python process (nothing imported or read yet) and require it to pass."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
