"""Command-line overrides in Hydra's grammar, applied to a loaded spec tree.

The forms (parsed by hydra-core's own override parser, so values read exactly as Hydra reads them:
``8`` is an int, ``1e-3`` a float, ``null`` None, ``[a,b]`` a list, ``{}`` an empty mapping,
``'8'`` a string):

- ``key=value`` sets a key, whether or not the file (or its ``extends`` chain) sets it: the typed
  spec has a default for every key a file leaves out, so unlike Hydra a key need not be in the file.
  A key the spec does not know (``trainer.stpes``) is named by validation, with a "did you mean",
  together with every other problem of the spec.
- ``+key=value`` adds a key the file does not set; refused when it is set (write ``key=value``).
- ``++key=value`` sets a key whether or not the file sets it.
- ``~key`` deletes a key (``~key=value``: only when it holds that value); the typed default applies.
- ``key=null`` sets None: for a plugin's ``options`` that means none (``{}``).

An override that names another plugin (``data.train.source=my.jsonl``, ``roles.rollout.backend=vllm``)
drops the options beside it, which were the other plugin's, as a file in an ``extends`` chain does;
options given by later overrides apply to the new plugin.

A value Hydra reads as a number or boolean (``name=2024``) lands on a field that takes text as the
text typed, so a string option never needs ``'"8"'``: the target field's type decides, after the
grammar. A value made of characters the grammar has no token for (``~/data.jsonl``, ``a#b``) and
no structure (brackets, quotes, commas) is the text typed, where Hydra would refuse it. Sweeps (``a=1,2``), packages
(``a@pkg=1``) and ``hydra.*`` keys have no meaning for a
single run and are refused.

Hydra's parser is imported only when there are overrides (importing ``hydra`` costs ~0.4 s, which
``relax validate SPEC`` without overrides does not pay).
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from omegaconf import DictConfig, ListConfig, Node, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel

from relax.config.bounded_yaml import LimitExceeded, Limits, check_json_shape
from relax.errors import SpecError, SpecIssue

#: In a mapping that names a plugin, the key naming it and the key holding its options. When a
#: file in an ``extends`` chain names another plugin than its parent does, the parent's options
#: are dropped: they were written for the other plugin (``options: {size: 4096}`` of
#: ``synthetic:arithmetic`` mean nothing to a ``.jsonl`` file).
PLUGIN_OPTION_KEYS: tuple[tuple[str, str], ...] = (
    ("source", "options"),                    # data.train, data.eval
    ("name", "options"),                      # rewards (lists are replaced whole anyway)
    ("path", "options"),                      # model: builtin:<name> options
    ("backend", "options"),                   # roles.rollout, roles.actor, ...
    ("environment", "environment_options"),   # roles.rollout.agent
    ("advantage", "advantage_options"),       # algorithm
    ("loss", "loss_options"),                 # algorithm
)

#: An override longer than this is not a command-line value (the spec file holds large ones).
MAX_OVERRIDE_CHARS = 64 * 1024
#: What every form of an override looks like, for messages about a malformed one.
GRAMMAR = "a.b.c=value, +a.b.c=value (add), ++a.b.c=value (add or change), ~a.b.c (delete) or a.b.c=null"

_MISSING = object()
#: Characters that give a value structure in Hydra's grammar; a value the grammar refuses that holds
#: none of them is taken as the text typed (``model.path=~/models/x``), one that holds them is an error.
_STRUCTURE = set("[]{}(),'\"\\= ")


@dataclass(frozen=True)
class Override:
    """One parsed command-line override."""

    op: Literal["change", "add", "force_add", "delete"]
    key: str
    value: Any
    """The value as Hydra's grammar reads it (None for a bare ``~key``)."""
    text: str | None
    """The value as typed (after the first ``=``), for a field that takes text; None when absent."""
    item: str
    """The whole override as given, for messages."""

    @property
    def has_value(self) -> bool:
        return self.text is not None


def _malformed(item: str, why: str = "") -> SpecError:
    detail = f": {why}" if why else ""
    return SpecError([SpecIssue("", f"override '{item}' is not of the form a.b.c=value{detail}",
                                f"write {GRAMMAR}; quote a value holding spaces or , [ ] {{ }}: key='a, b'")])


def parse_override(item: str) -> Override:
    """One override string parsed by Hydra's grammar (``SpecError`` naming it when malformed)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    stripped = item.strip()
    body = stripped.lstrip("+~")
    key_part = body.partition("=")[0]
    if not stripped.startswith("~") and "=" not in stripped:
        raise _malformed(item, "there is no '='")
    if not key_part or any(not part for part in key_part.split(".")):
        raise _malformed(item, "the key is empty or has an empty part")
    parser = OverridesParser.create()
    _, sep, text = stripped.partition("=")
    plain_text = False
    if len(text) > MAX_OVERRIDE_CHARS:
        raise SpecError([SpecIssue(key_part, f"override value is refused: it is {len(text)} characters, more "
                                             f"than the {MAX_OVERRIDE_CHARS} an override may hold",
                                   "put large values in the spec file")])
    try:
        parsed = parser.parse_override(stripped)
    except RecursionError:
        raise SpecError([SpecIssue(key_part, f"override value is refused: lists and mappings nest more than "
                                             f"{Limits().max_depth} deep", "give a small value")]) from None
    except HydraException as exc:
        if not sep or not text or _STRUCTURE & set(text):
            raise _malformed(item, str(exc).splitlines()[0]) from None
        try:  # a value of characters the grammar has no token for (~/data.jsonl): the text typed
            parsed = parser.parse_override(f"{stripped.partition('=')[0]}=x")
        except HydraException:
            raise _malformed(item, str(exc).splitlines()[0]) from None
        plain_text = True
    key = parsed.key_or_group
    if parsed.package is not None:
        raise _malformed(item, "'@package' has no meaning in a run spec")
    if key.split(".")[0] == "extends":
        raise SpecError([SpecIssue("extends", f"override '{item}': extends cannot be set on the command line "
                                              "(the files it names are read before overrides apply)",
                                   "write extends: in the spec file, or give the preset as the spec")])
    if key.split(".")[0] == "hydra":
        raise SpecError([SpecIssue(key, f"override '{item}': a run spec has no hydra section",
                                   "remove the override; Relax uses only Hydra's override grammar")])
    if parsed.is_sweep_override():
        raise SpecError([SpecIssue(key, f"override '{item}' is a sweep in Hydra's grammar (several values)",
                                   f"give one value; for a list write {key}=[{text}], for text with a comma "
                                   f"quote it: {key}='{text}'")])
    op = "delete" if parsed.is_delete() else "force_add" if parsed.is_force_add() else \
        "add" if parsed.is_add() else "change"
    value = text.strip() if plain_text else parsed.value() if sep else None
    try:
        check_json_shape(value)  # the spec file's node and depth caps
    except LimitExceeded as exc:
        raise SpecError([SpecIssue(key, f"override value is refused: {exc}", "give a small value")]) from None
    return Override(op=op, key=key, value=value, text=text if sep else None, item=item)


# --- the typed spec's shape ------------------------------------------------------------------------

class _FreeForm:
    """Marks a place in the spec where any key is accepted (a plugin's options, ``Any``)."""


FREE = _FreeForm()


def _members(annotation: Any) -> list[Any]:
    """The alternatives of a union (``X | None``), or the annotation itself."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return list(typing.get_args(annotation))
    return [annotation]


def _step(annotation: Any, part: str) -> Any:
    """The annotation one key below ``annotation``, ``FREE`` below a free-form mapping, or
    ``_MISSING`` when the typed spec has no such key."""
    if annotation is Any:
        return FREE
    for member in _members(annotation):
        origin = typing.get_origin(member)
        if isinstance(member, type) and issubclass(member, BaseModel):
            field = member.model_fields.get(part)
            if field is not None:
                return field.annotation
        elif origin is dict:
            value = typing.get_args(member)[1]
            return FREE if value is Any else value
        elif origin is list and part.lstrip("-").isdigit():
            return typing.get_args(member)[0]
    return _MISSING


def spec_field(key: str) -> Any:
    """The annotation of the typed spec's field at a dotted key (list items by index), ``FREE``
    inside a free-form mapping, ``_MISSING`` when the spec has no such key."""
    from relax.spec.models import RunSpec

    annotation: Any = RunSpec
    for part in key.split("."):
        annotation = _step(annotation, part)
        if annotation is _MISSING or annotation is FREE:
            return annotation
    return annotation


def _admits(annotation: Any, kind: type) -> bool:
    """Whether a field of this annotation takes values of ``kind`` as they are."""
    for member in _members(annotation):
        if member is Any or member is kind or (kind is int and member is float):
            return True
        if typing.get_origin(member) is Literal and any(type(arg) is kind for arg in typing.get_args(member)):
            return True
    return False


def typed_value(override: Override) -> Any:
    """The override's value for its target field: Hydra's reading, except that a number or boolean
    typed for a field that takes text (and not that number) is the text as typed."""
    value = override.value
    if override.text is None or not isinstance(value, (bool, int, float)):
        return value
    annotation = spec_field(override.key)
    if annotation is _MISSING or annotation is FREE:
        return value
    if _admits(annotation, str) and not _admits(annotation, type(value)):
        return override.text.strip()
    return value


# --- applying -------------------------------------------------------------------------------------

def _present(cfg: DictConfig, key: str) -> Any:
    """The node at ``key`` in the loaded tree, or ``_MISSING``. Nodes are walked as written, never
    resolved: an override may replace a value that interpolates a missing key (``name=${nope}``
    then ``name=1``), and looking at it must not resolve the interpolation it replaces."""
    node: Any = cfg
    for part in key.split("."):
        if isinstance(node, DictConfig) and part in node:
            node = node._get_node(part)
        elif isinstance(node, ListConfig) and part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node):
            node = node._get_node(int(part))
        else:
            return _MISSING
    return node


def _plain(value: Any) -> Any:
    """A node as plain Python, interpolations left as written."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=False)
    return value._value() if isinstance(value, Node) else value


def _delete(cfg: DictConfig, override: Override) -> None:
    key = override.key
    current = _present(cfg, key)
    if current is _MISSING:
        raise SpecError([SpecIssue(key, f"override '{override.item}': the spec does not set {key}, so there is "
                                        "nothing to delete", "remove the override (the default applies already)")])
    if override.has_value and _plain(current) != override.value:
        raise SpecError([SpecIssue(key, f"override '{override.item}': {key} is {_plain(current)!r}, not "
                                        f"{override.value!r}", f"write ~{key} to delete it whatever it holds")])
    parent_key, _, last = key.rpartition(".")
    parent = _present(cfg, parent_key) if parent_key else cfg
    if isinstance(parent, ListConfig):
        del parent[int(last)]
    else:
        del parent[last]


def _drop_other_plugins_options(cfg: DictConfig, key: str, value: Any) -> None:
    """An override naming another plugin (``data.train.source=my.jsonl``) drops the options beside
    it, as a child file in an ``extends`` chain does (``PLUGIN_OPTION_KEYS``):
    they were the other plugin's. Options given by a later override still apply."""
    parent_key, _, last = key.rpartition(".")
    parent = _present(cfg, parent_key) if parent_key else cfg
    if not isinstance(parent, DictConfig):
        return
    for name_key, options_key in PLUGIN_OPTION_KEYS:
        if last == name_key and options_key in parent and _plain(parent._get_node(name_key)) != value:
            del parent[options_key]


def apply_override(cfg: DictConfig, override: Override) -> None:
    """Apply one override to the loaded tree, in place (``SpecError`` naming it when it cannot)."""
    key = override.key
    if override.op == "delete":
        _delete(cfg, override)
        return
    present = _present(cfg, key) is not _MISSING
    if override.op == "add" and present:
        raise SpecError([SpecIssue(key, f"override '{override.item}': the spec already sets {key}; '+' adds "
                                        "a key the spec does not set", f"write {key}=... to change it "
                                        f"(or ++{key}=... to set it either way)")])
    value = typed_value(override)
    _drop_other_plugins_options(cfg, key, value)
    try:
        OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    except (OmegaConfBaseException, IndexError, ValueError, TypeError) as exc:
        raise SpecError([SpecIssue(key, f"override cannot be applied: {exc}".splitlines()[0],
                                   "check the path exists in the spec (lists take an index: "
                                   "rewards.0.weight)")]) from None
