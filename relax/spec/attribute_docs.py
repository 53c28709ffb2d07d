"""Field docstrings as descriptions, read when a schema or help text asks for them, not at import.

Every field of a spec, plan or plugin model has a docstring under it; that docstring is the field's
description in the JSON Schema, in ``docs/spec-reference.md`` and in ``relax plugins``. pydantic
can read them as it builds each class (``use_attribute_docstrings``), but before Python 3.13 it
finds a class's source by walking the stack and tokenizing and parsing the class's block again,
about a millisecond per class: for the fifty spec and plan models and the ``Config`` of each plugin
a spec names, a quarter of ``relax validate``'s time, spent on text that validation never shows.

So ``DocumentedModel`` (the base of the spec sections, the plan's parts and the model
architecture) leaves that option off, and ``document(model)`` fills the descriptions in on demand:
it parses each source file once, gives every field the docstring pydantic would have given it, and
rebuilds the model, after the models its fields hold, so that its JSON Schema carries them.
``DocumentedModel.model_json_schema`` calls it, so the schema is what it always was; code reading
``model_fields[...].description`` calls ``document`` first. A plugin ``Config`` may still set
``use_attribute_docstrings=True`` (docs/plugin-guide.md); ``document`` then has nothing to add.
"""

from __future__ import annotations

import ast
import inspect
import sys
import types
import typing
from typing import Any

from pydantic import BaseModel

#: Models already documented, and whether that changed their schema (their own descriptions or
#: those of a model they hold), which makes every model holding them stale until rebuilt.
_done: dict[type[BaseModel], bool] = {}

#: Per module: class qualified name -> {attribute: docstring}; None for a name defined twice.
_module_docs: dict[str, dict[str, dict[str, str] | None]] = {}


class DocumentedModel(BaseModel):
    """A model whose field docstrings are its descriptions, read on first need (see the module
    docstring): ``model_json_schema`` carries them, as with ``use_attribute_docstrings``."""

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        document(cls)
        return super().model_json_schema(*args, **kwargs)


def document(model: type[BaseModel]) -> type[BaseModel]:
    """``model`` with each field's docstring as its description (where it has none), like
    ``use_attribute_docstrings``, and so every model its fields hold; returns ``model``."""
    _document(model, set())
    return model


def _document(model: type[BaseModel], visiting: set[type[BaseModel]]) -> bool:
    """Fill ``model``'s descriptions, after those of the models it holds; True when its schema
    had to change (rebuilt here)."""
    if model in _done:
        return _done[model]
    if model in visiting:  # a model that holds itself, directly or not: documented where the walk began
        return False
    visiting.add(model)
    stale = False
    for field in model.model_fields.values():
        for held in _models_in(field.annotation):
            stale |= _document(held, visiting)
    for name, field in model.model_fields.items():
        if field.description is None and (doc := _field_docstring(model, name)) is not None:
            field.description = doc
            stale = True
    if stale:
        model.model_rebuild(force=True)
    visiting.discard(model)
    _done[model] = stale
    return stale


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds: ``X``, ``X | None``, ``list[X]``, ``dict[str, X]``."""
    if isinstance(annotation, type) and not isinstance(annotation, types.GenericAlias) \
            and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in _models_in(arg)]


def _field_docstring(model: type[BaseModel], name: str) -> str | None:
    """The docstring under field ``name`` in the class that declares it: the first of ``model``'s
    bases whose own annotations hold it (pydantic gives a subclass the inherited field's
    description, and a field declared again only the docstring written under it there)."""
    for cls in model.__mro__:
        if name in cls.__dict__.get("__annotations__", {}):
            docs = _class_docs(cls)
            return docs.get(name) if docs else None
    return None


def _class_docs(cls: type) -> dict[str, str] | None:
    """{attribute: docstring} of one class body, from its module's source parsed once; None when
    the source is not at hand or the module defines that qualified name more than once."""
    module = cls.__module__
    if module not in _module_docs:
        _module_docs[module] = _parse_module(sys.modules.get(module))
    return _module_docs[module].get(cls.__qualname__)


def _parse_module(module: types.ModuleType | None) -> dict[str, dict[str, str] | None]:
    try:
        tree = ast.parse(inspect.getsource(module)) if module is not None else None
    except (OSError, TypeError, SyntaxError):
        tree = None
    found: dict[str, dict[str, str] | None] = {}
    if tree is not None:
        _collect(tree.body, "", found)
    return found


def _collect(body: list[ast.stmt], prefix: str, found: dict[str, dict[str, str] | None]) -> None:
    """Walk a module or function body for class definitions, naming them as ``__qualname__``
    does (``Outer.Inner``, ``function.<locals>.Inner``)."""
    for node in body:
        if isinstance(node, ast.ClassDef):
            qualname = prefix + node.name
            found[qualname] = None if qualname in found else _attribute_docstrings(node.body)
            _collect(node.body, qualname + ".", found)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            _collect(node.body, f"{prefix}{node.name}.<locals>.", found)
        else:
            for field_name in ("body", "orelse", "finalbody", "handlers"):  # if/try/with/for blocks
                nested = getattr(node, field_name, None)
                if isinstance(nested, list):
                    _collect([n for n in nested if isinstance(n, ast.AST)], prefix, found)


def _attribute_docstrings(body: list[ast.stmt]) -> dict[str, str]:
    """``name: type = ...`` followed by a string statement, as pydantic reads them (the string
    ``inspect.cleandoc``-ed)."""
    docs = {}
    for previous, node in zip(body, body[1:]):
        if (isinstance(previous, ast.AnnAssign) and isinstance(previous.target, ast.Name)
                and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            docs[previous.target.id] = inspect.cleandoc(node.value.value)
    return docs
