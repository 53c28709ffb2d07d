"""Load a run spec file into a plain dict: YAML/JSON, ``extends:``, ``${...}`` and overrides.

Loading is safe: YAML goes through PyYAML's safe loader, counting nodes as it composes them so that
a file past its size, node or depth caps (``relax.config.bounded_yaml``) is refused before anything
expands its aliases; and only omegaconf's built-in resolvers (``${oc.env:...}`` and friends) exist,
none of which runs code from the spec. ``${...}`` is resolved under a budget
(``relax.config.interpolation_budget``), checked before omegaconf expands anything. Problems are raised as ``SpecError``
with the offending path,
like validation errors.

omegaconf is imported only for a file that needs it (``extends``, overrides, an interpolation
beyond ``${a.b}``): a plain file is resolved by ``relax.config.plain``, to the same dict, without
the ~40 ms of importing it (``relax validate tiny-cpu`` is one such file).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from relax.config.bounded_yaml import LimitExceeded, load_json, load_yaml, read_text_within
from relax.config.interpolation_budget import check_budget
from relax.config.plain import resolve_plain
from relax.config.redaction import NONE as NO_REDACTIONS
from relax.config.redaction import (
    REDACTED,
    Redactions,
    dotted,
    escape_env_expressions,
    from_resolution,
    holds_redacted,
    strings_in,
)
from relax.errors import SpecError, SpecIssue

if TYPE_CHECKING:
    from omegaconf import DictConfig



def shipped_presets_dir() -> Path:
    """The presets shipped with this copy of relax: in a checkout (an editable install, or the
    checkout on ``PYTHONPATH``) its top-level ``presets/``; in an installed wheel the package data
    ``relax/presets/``, where the build maps ``presets/`` (``setup.py``)."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / "presets").is_dir():
        return checkout / "presets"
    found = importlib.util.find_spec("relax.presets")
    if found is not None and found.submodule_search_locations:
        return Path(next(iter(found.submodule_search_locations)))
    return Path(__file__).resolve().parents[1] / "presets"


#: The presets shipped with relax (``presets/`` at the top of the checkout, package data of the
#: wheel as ``relax/presets/``); searched for ``extends: <name>`` and ``relax run <name>`` after
#: ``$RELAX_PRESETS_PATH``.
PRESETS_DIR = shipped_presets_dir()
PRESETS_ENV = "RELAX_PRESETS_PATH"
MAX_EXTENDS_DEPTH = 16


def preset_dirs() -> list[Path]:
    """Where preset names are looked up: ``$RELAX_PRESETS_PATH`` entries, then the shipped presets."""
    extra = [Path(p) for p in os.environ.get(PRESETS_ENV, "").split(os.pathsep) if p]
    return [*extra, PRESETS_DIR]


def list_presets() -> list[str]:
    """Names of the presets that ``extends:`` (and ``relax run <name>``) accept."""
    names: set[str] = set()
    for folder in preset_dirs():
        if folder.is_dir():
            names.update(p.stem for p in folder.glob("*.yaml"))
    return sorted(names)


def resolve_spec_path(ref: str, base_dir: Path) -> Path:
    """A spec reference as a file: a path (relative to ``base_dir``) or a preset name."""
    candidate = Path(ref).expanduser()
    candidate = candidate if candidate.is_absolute() else base_dir / candidate
    if candidate.is_file():
        return candidate
    if not candidate.suffix:
        for folder in preset_dirs():
            preset = folder / f"{ref}.yaml"
            if preset.is_file():
                return preset
    raise FileNotFoundError(ref)


def _read(path: Path) -> dict[str, Any]:
    try:
        text = read_text_within(path)
        data = load_json(text) if path.suffix.lower() == ".json" else load_yaml(text)
    except LimitExceeded as exc:
        raise SpecError([SpecIssue("", f"{path} is refused: {exc}",
                                   "a run spec is a small file; remove the repetition or the nesting")]) from None
    except UnicodeDecodeError as exc:
        raise SpecError([SpecIssue("", f"{path} is not UTF-8 text: byte {exc.start} is "
                                       f"0x{exc.object[exc.start]:02x}",
                                   "save the spec as UTF-8")]) from None
    except IsADirectoryError:
        raise SpecError([SpecIssue("", f"{path} is a folder, not a spec file",
                                   "give the path of a YAML or JSON file")]) from None
    except OSError as exc:
        raise SpecError([SpecIssue("", f"{path} cannot be read: {exc.strerror or exc}", "")]) from None
    except json.JSONDecodeError as exc:
        raise SpecError([SpecIssue("", f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}",
                                   "fix the syntax")]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError([SpecIssue("", f"{path} is not valid YAML{where}: {problem}",
                                   "fix the syntax")]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SpecError([SpecIssue("", f"{path} holds a {type(data).__name__}, not a mapping",
                                   "a run spec is a mapping of sections (name:, model:, ...)")])
    return data


def _load_tree(path: Path, chain: tuple[Path, ...], data: dict[str, Any] | None = None) -> DictConfig:
    """The file at ``path`` merged over its ``extends`` chain (``data``: the file, if already read)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise SpecError([SpecIssue("extends", f"extends loops: {cycle}", "remove the cycle")])
    if len(chain) > MAX_EXTENDS_DEPTH:
        raise SpecError([SpecIssue("extends", f"the extends chain from {chain[0]} is too deep: it reaches {path} "
                                              f"past the depth limit of {MAX_EXTENDS_DEPTH} extends (not a loop)",
                                   "merge some of the files into one")])
    data = _read(path) if data is None else data
    parent = data.get("extends")
    try:
        node = OmegaConf.create(data)
    except OmegaConfBaseException as exc:
        raise SpecError([SpecIssue("", f"{path}: {exc}", "")]) from None
    if parent is None:
        return node
    if not isinstance(parent, str):
        raise SpecError([SpecIssue("extends", f"{parent!r} is not a preset name or a path",
                                   "give a string")])
    try:
        parent_path = resolve_spec_path(parent, path.parent)
    except FileNotFoundError:
        raise SpecError([SpecIssue("extends", f"no preset or file named '{parent}' (from {path})",
                                   f"use a path or one of the presets: {', '.join(list_presets())}")]) from None
    base = _load_tree(parent_path.resolve(), (*chain, path))
    return merge_child(base, node)


def _replace_marks(base: DictConfig, child: DictConfig) -> None:
    """Drop from ``base`` what ``child`` replaces rather than merges into (see ``merge_child``)."""
    from omegaconf import DictConfig

    from relax.config.overrides import PLUGIN_OPTION_KEYS

    for key in list(child.keys()):
        if key not in base:
            continue
        theirs = child._get_node(key)
        mine = base._get_node(key)
        if isinstance(theirs, DictConfig) and not theirs._is_none() and isinstance(mine, DictConfig) \
                and not mine._is_none():
            if len(theirs) == 0:
                del base[key]  # an explicit {}: the parent's mapping is replaced by an empty one
            else:
                _replace_marks(mine, theirs)
    for name_key, options_key in PLUGIN_OPTION_KEYS:
        if name_key in child and name_key in base and options_key in base \
                and _scalar(child, name_key) != _scalar(base, name_key):
            del base[options_key]


def _scalar(cfg: DictConfig, key: str) -> Any:
    from omegaconf import DictConfig, ListConfig

    node = cfg._get_node(key)
    return node._value() if node is not None and not isinstance(node, (DictConfig, ListConfig)) else id(node)


def merge_child(base: DictConfig, child: DictConfig) -> DictConfig:
    """A file merged over its ``extends`` parent: mappings merge key by key, the child winning,
    except that the child replaces the parent's value

    - for a list (lists are never merged item by item);
    - for ``null`` (``options: null`` means none);
    - for an empty mapping (``options: {}`` means none, not "add nothing");
    - for a plugin's options when the child names another plugin than the parent
      (``PLUGIN_OPTION_KEYS``: a ``source``, ``name``, ``path``, ``backend``, ``environment``,
      ``advantage`` or ``loss`` that differs drops the parent's options beside it).
    """
    from omegaconf import DictConfig, OmegaConf

    base = copy.deepcopy(base)
    _replace_marks(base, child)
    merged = OmegaConf.merge(base, child)
    assert isinstance(merged, DictConfig)
    return merged


@dataclass(frozen=True)
class LoadedSpec:
    """A spec file as the loader read it: the resolved dict, the folder relative paths in it are
    taken from, and what of it must not be written or printed (``relax.config.redaction``)."""

    raw: dict[str, Any]
    base_dir: Path
    redactions: Redactions = NO_REDACTIONS


def load_spec_dict(ref: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[dict[str, Any], Path]:
    """The spec as a plain dict, and the folder relative paths in it are taken from (``load_spec``
    without its redactions)."""
    loaded = load_spec(ref, overrides)
    return loaded.raw, loaded.base_dir


def load_spec(ref: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> LoadedSpec:
    """The spec as a plain dict, the folder relative paths in it are taken from, and the values
    that came from ``${oc.env:...}`` (to be written as their expressions, never their values).

    ``ref`` is a file path or a preset name. ``extends`` chains are merged base-first (see
    ``merge_child``), overrides (Hydra's grammar, ``relax.config.overrides``) are applied last, then
    ``${...}`` interpolations are resolved. A spec holding ``<redacted>`` (a ``spec.yaml`` a run
    wrote, whose credential was not taken from the environment) is refused.
    """
    try:
        path = resolve_spec_path(str(ref), Path.cwd()).resolve()
    except FileNotFoundError:
        raise SpecError([SpecIssue("", f"spec '{ref}' is neither a file nor a preset",
                                   f"give a YAML/JSON path or one of: {', '.join(list_presets())}")]) from None
    data = _read(path)
    if not overrides and (plain := resolve_plain(data)) is not None:
        return _refuse_redacted(LoadedSpec(plain, path.parent))
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = _load_tree(path, (), data)
    if overrides:
        from relax.config.overrides import apply_override, parse_override

        for item in overrides:
            apply_override(cfg, parse_override(item))
    check_budget(cfg)  # refuse an interpolation bomb before omegaconf expands it
    try:
        data = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", "") or ""
        message = str(exc).splitlines()[0]
        raise SpecError([SpecIssue(str(key), f"cannot resolve interpolation: {message}",
                                   "refer to an existing key, e.g. ${name}")]) from None
    assert isinstance(data, dict)
    resolved = _plain(data)
    return _refuse_redacted(LoadedSpec(resolved, path.parent, _env_redactions(cfg, resolved)))


def _env_redactions(cfg: DictConfig, resolved: dict[str, Any]) -> Redactions:
    """What of ``cfg`` came from ``${oc.env:...}``: ``cfg`` resolved again with each such
    expression kept as its text, compared with ``resolved`` (``redaction.from_resolution``)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    unresolved = _plain(OmegaConf.to_container(cfg, resolve=False))
    if not any("oc.env" in text for text in strings_in(unresolved)):
        return NO_REDACTIONS
    try:
        shown = _plain(OmegaConf.to_container(OmegaConf.create(escape_env_expressions(unresolved)), resolve=True))
    except OmegaConfBaseException:
        shown = None  # each leaf using oc.env is then shown as written
    return from_resolution(unresolved, resolved, shown)


def _refuse_redacted(loaded: LoadedSpec) -> LoadedSpec:
    """A run writes a credential it did not take from the environment as ``<redacted>``: such a
    ``spec.yaml`` cannot repeat the run until the value is given again."""
    where = holds_redacted(loaded.raw)
    if where is not None:
        raise SpecError([SpecIssue(dotted(where), f"holds {REDACTED}: a run writes a credential that is not taken "
                                                  "from the environment this way, never its value",
                                   "give the value from the environment: ${oc.env:NAME} in the spec, or the "
                                   "plugin's headers_env / token_env")])
    return loaded


def _plain(value: Any) -> Any:
    """omegaconf containers to plain Python, keys as strings."""
    from omegaconf import DictConfig, ListConfig

    if isinstance(value, (dict, DictConfig)):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, ListConfig)):
        return [_plain(v) for v in value]
    return value
