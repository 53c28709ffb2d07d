"""What validation knows of a spec with shape errors: every field that is sound.

One round reports every problem. A shape error (a wrong type, a value out of range, an unknown
key) is reported by pydantic; the rules must still judge everything else. So the broken fields
are cut out of the raw spec (each takes its default), the rest validates, and each cut field is
then replaced in the typed spec by an ``Unsound`` marker: any use of it (a comparison, arithmetic,
truth, iteration, an attribute, formatting) raises ``UnsoundRead``, which stops the rule reading
it. A rule thus runs whenever the fields it reads are sound, field by field; it never judges a
default standing in for what the user wrote. What it found before touching a broken field stands
(none of it depended on that field).

A broken list item cuts its whole list (cutting one item would renumber the others); an error
of a whole section (a check of the section's validator) cuts the section; a missing required key
cuts the mapping that lacks it. An unknown key whose name is close to a field's (``replica`` for
``replicas``) marks that field unsound too: the user's value for it is in the misspelt key.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from relax.errors import join_path
from relax.errors.translate import closest
from relax.spec.models import RunSpec

#: Rounds of cutting before giving up (each round cuts at least one level higher than a key that
#: failed again; a spec is far shallower than this).
MAX_ROUNDS = 12
#: Stands in for a missing or broken ``name`` (the one field a spec must give).
PLACEHOLDER_NAME = "partial"

Part = str | int
T = TypeVar("T")


class UnsoundRead(BaseException):
    """A rule used a field that has a shape error. A ``BaseException``, so that a rule's own
    ``except Exception`` (around a plugin's ``Config``, say) cannot swallow it into a finding."""

    def __init__(self, path: str):
        super().__init__(path)
        self.path = path


def _refuse(self: Unsound, *args: Any, **kwargs: Any) -> Any:
    raise UnsoundRead(self.path)


class Unsound:
    """A field with a shape error, in the typed spec validation's rules read. Every use raises
    ``UnsoundRead``; ``is None`` and ``isinstance`` cannot be intercepted and see a value that is
    present and of no field type (which is what the user wrote: something, but not this)."""

    __slots__ = ("path",)

    def __init__(self, path: str):
        object.__setattr__(self, "path", path)

    def __getattr__(self, name: str) -> Any:
        raise UnsoundRead(self.path)

    def __repr__(self) -> str:
        return f"<unsound {self.path}>"

    __setattr__ = __bool__ = __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __hash__ = _refuse
    __len__ = __iter__ = __contains__ = __getitem__ = __format__ = __str__ = __int__ = __float__ = _refuse
    __index__ = __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = _refuse
    __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __neg__ = __abs__ = __call__ = _refuse


def is_unsound(value: Any) -> bool:
    """Whether ``value`` is a broken field's marker (a check that uses it in no other way)."""
    return type(value) is Unsound


def soundly(items: Iterable[T]) -> Iterator[T]:
    """The items of ``items`` up to the first that needs a broken field: for a rule that walks
    several independent parts, so that a broken one ends only its own walk."""
    try:
        yield from items
    except UnsoundRead:
        return


def findings(check: Any, spec: RunSpec, ctx: Any) -> list[Any]:
    """What ``check`` yields on ``spec`` until it uses a broken field."""
    return list(soundly(check(spec, ctx)))


def sound_spec(raw: Any) -> tuple[RunSpec | None, list[str]]:
    """The spec with every broken field cut out and marked ``Unsound``, and the dotted paths
    marked; ``(None, [])`` when no typed spec can be had (the spec is not a mapping)."""
    if not isinstance(raw, dict):
        return None, []
    work = copy.deepcopy(raw)
    cuts: list[tuple[Part, ...]] = []
    typos: list[tuple[Part, ...]] = []
    for _ in range(MAX_ROUNDS):
        try:
            spec = RunSpec.model_validate(work)
        except ValidationError as exc:
            progress = False
            for err in exc.errors():
                cut, typo = _cut(work, tuple(err["loc"]), err["type"], set(cuts))
                if cut is not None:
                    cuts.append(cut)
                    progress = True
                if typo is not None:
                    typos.append(typo)
            if not progress:
                return None, []
            continue
        marked = [path for path in (*cuts, *_typo_targets(spec, typos)) if _mark(spec, path)]
        return spec, sorted({join_path(*path) for path in marked})
    return None, []


def _cut(work: dict[str, Any], loc: tuple[Any, ...], kind: str,
         done: set[tuple[Part, ...]]) -> tuple[tuple[Part, ...] | None, tuple[Part, ...] | None]:
    """Cut what the error at ``loc`` is about out of ``work``: the path cut (None when nothing
    could be, or a cut before this one, in ``done``, took it), and for an unknown key, its path
    (whose close field is then marked too)."""
    path: list[Part] = []
    node: Any = work
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            # a broken item cuts its whole list: cutting the item alone would renumber the rest
            return _cut_at(work, path), None
        if isinstance(node, dict) and part in node:
            if last:
                path.append(part)
                typo = tuple(path) if kind == "extra_forbidden" else None
                return _cut_at(work, path), typo
            path.append(part)
            node = node[part]
            continue
        if (*path, part) in done:
            return None, None  # in a part already cut
        if isinstance(node, dict) and not last and loc[i + 1] in node:
            continue  # a union's tag or a validator's name in pydantic's location, not a key
        if not path and part == "name":
            path.append(part)  # a missing name: the one key of a spec without a default
        break  # a missing key (or a value that is not a mapping): cut the mapping that holds it
    return _cut_at(work, path), None


def _cut_at(work: dict[str, Any], path: list[Part]) -> tuple[Part, ...] | None:
    """Remove ``path`` from ``work`` (its default then applies): the path, or None at the root."""
    if not path:
        return None
    parent: Any = work
    for part in path[:-1]:
        parent = parent[part]
    key = path[-1]
    if len(path) == 1 and key == "name":
        if parent.get("name") == PLACEHOLDER_NAME:
            return None
        parent["name"] = PLACEHOLDER_NAME  # the one key without a default
    elif isinstance(parent, dict) and key in parent:
        del parent[key]
    else:
        return None
    return tuple(path)


def _typo_targets(spec: RunSpec, typos: list[tuple[Part, ...]]) -> Iterator[tuple[Part, ...]]:
    """For each unknown key, the field of its model whose name is close to it."""
    for path in typos:
        owner = _resolve(spec, path[:-1])
        if isinstance(owner, BaseModel) and isinstance(path[-1], str):
            meant = closest(path[-1], type(owner).model_fields)
            if meant is not None:
                yield (*path[:-1], meant)


def _resolve(spec: RunSpec, path: tuple[Part, ...]) -> Any:
    node: Any = spec
    for part in path:
        if isinstance(node, BaseModel) and isinstance(part, str) and part in type(node).model_fields:
            node = getattr(node, part)
        elif isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            return None
    return node


def _mark(spec: RunSpec, path: tuple[Part, ...]) -> bool:
    """Put an ``Unsound`` marker at ``path`` of the typed spec: on a model's field, or on a key of
    a mapping field. False where the path leads to no field (an unknown key)."""
    owner = _resolve(spec, path[:-1])
    key = path[-1]
    marker = Unsound(join_path(*path))
    if isinstance(owner, BaseModel) and isinstance(key, str) and key in type(owner).model_fields:
        object.__setattr__(owner, key, marker)  # past pydantic's checks: the marker is no field value
        return True
    if isinstance(owner, dict) and not is_unsound(owner):
        owner[key] = marker
        return True
    return False
