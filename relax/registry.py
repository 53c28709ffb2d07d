"""Plugin discovery through entry points, the same way in the driver and in every Ray worker.

One entry-point group per kind (``relax.rollout``, ``relax.rewards``, ...; see
``relax.contracts.PluginKind``). Discovery reads package metadata only; a plugin's module is
imported the first time it is asked for by name, once per process. The built-in plugins in
``relax_plugins`` are registered by this project's own ``pyproject.toml`` exactly like a third
party's, and the core never imports them by name.

A plugin that fails to import, lacks a ``Config`` model, whose hooks do not match the contract or
which declares a trait (``relax.contracts.TRAITS``) of the wrong type or value is reported with its
distribution and entry point, and does not affect the other plugins. Traits are read through
``trait`` (the declared default when a class does not set one), never with a bare ``getattr``.
"""

from __future__ import annotations

import functools
import inspect
import threading
from dataclasses import dataclass
from importlib.metadata import Distribution, EntryPoint, entry_points
from typing import Any

from pydantic import BaseModel, ValidationError

from relax.contracts import CAPABILITIES, HOOKS, OPTIONAL_HOOKS, TRAITS, Hook, PluginKind, protocol_hooks
from relax.errors import SpecIssue
from relax.errors.translate import issues_from_validation_error


@dataclass(frozen=True)
class PluginEntry:
    """A discovered plugin, before its module is imported."""

    kind: PluginKind
    name: str
    target: str
    distribution: str
    version: str

    def describe(self) -> str:
        return f"'{self.name}' ({self.target}, from {self.distribution} {self.version})"


@functools.cache
def _name_and_version(dist: Distribution | None) -> tuple[str, str]:
    """A distribution's name and version, its ``METADATA`` parsed once for all its plugins
    (``dist.name`` and ``dist.version`` parse it again each time: twice per entry point, 66 parses
    of one file for ``relax validate tiny-cpu``)."""
    if dist is None:
        return "<unknown>", "?"
    metadata = dist.metadata
    return metadata["Name"], metadata["Version"]


class PluginError(Exception):
    """A plugin cannot be used; the message says which one and what to do."""


class PluginNotFound(PluginError):
    """No plugin of that kind and name is installed."""


def _load_entry(ep: EntryPoint) -> Any:
    return ep.load()


class Registry:
    """Lazy, cached plugin lookup for one process."""

    def __init__(self) -> None:
        self._entries: dict[PluginKind, dict[str, tuple[PluginEntry, EntryPoint]]] = {}
        self._classes: dict[tuple[PluginKind, str], type] = {}
        self._failures: dict[tuple[PluginKind, str], PluginError] = {}
        self._lock = threading.Lock()
        self._all: Any = None

    def entries(self, kind: PluginKind | str) -> dict[str, PluginEntry]:
        """Installed plugins of a kind, by name, without importing them."""
        kind = PluginKind(kind)
        return {name: entry for name, (entry, _) in self._discover(kind).items()}

    def _discover(self, kind: PluginKind) -> dict[str, tuple[PluginEntry, EntryPoint]]:
        with self._lock:
            if kind not in self._entries:
                found: dict[str, tuple[PluginEntry, EntryPoint]] = {}
                if self._all is None:  # one scan of the installed metadata for every kind
                    self._all = entry_points()
                for ep in self._all.select(group=kind.group):
                    distribution, version = _name_and_version(ep.dist)
                    entry = PluginEntry(kind=kind, name=ep.name, target=ep.value, distribution=distribution,
                                        version=version)
                    found.setdefault(ep.name, (entry, ep))
                self._entries[kind] = found
            return self._entries[kind]

    def load(self, kind: PluginKind | str, name: str) -> type[Any]:
        """The plugin class, imported on first use and checked against the kind's contract."""
        kind = PluginKind(kind)
        key = (kind, name)
        if key in self._classes:
            return self._classes[key]
        if key in self._failures:
            raise self._failures[key]
        found = self._discover(kind)
        if name not in found:
            installed = ", ".join(sorted(found)) or "none"
            raise PluginNotFound(
                f"no {kind.value} plugin named '{name}' is installed (installed: {installed}); "
                f"install a package that registers it under the entry-point group '{kind.group}'"
            )
        entry, ep = found[name]
        try:
            try:
                cls = _load_entry(ep)
            except Exception as exc:  # a broken plugin must not take the others down
                raise PluginError(
                    f"{kind.value} plugin {entry.describe()} failed to import: "
                    f"{type(exc).__name__}: {exc}; fix or reinstall {entry.distribution}"
                ) from exc
            check_contract(kind, entry, cls)
        except PluginError as exc:
            self._failures[key] = exc
            raise
        self._classes[key] = cls
        return cls

    def validate_options(
        self, kind: PluginKind | str, name: str, options: dict[str, Any], path: str
    ) -> list[SpecIssue]:
        """Check a spec's ``options`` for a plugin against the plugin's ``Config``."""
        cls = self.load(kind, name)
        try:
            cls.Config.model_validate(options)
        except ValidationError as exc:
            entry = self.entries(kind)[name]
            issues = issues_from_validation_error(exc, cls.Config, prefix=path)
            return [
                SpecIssue(i.path, f"{i.message} (plugin {entry.describe()})", i.remedy, i.fix)
                for i in issues
            ]
        return []

    def build_config(self, kind: PluginKind | str, name: str, options: dict[str, Any]) -> BaseModel:
        """The plugin's typed ``Config`` from spec options (already validated)."""
        return self.load(kind, name).Config.model_validate(options)


def _params_after_self(func: Any) -> list[inspect.Parameter] | None:
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    return params


def _hook_matches(cls: type, hook: Hook) -> bool:
    func = getattr(cls, hook.name, None)
    if func is None or not callable(func):
        return False
    if hook.name == "__init__" and func is object.__init__:
        return not hook.params
    params = _params_after_self(func)
    if params is None:
        return False
    positional = [
        p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    has_var = any(p.kind is p.VAR_POSITIONAL for p in params)
    required_names = [p.name for p in positional if p.default is p.empty]
    expected = list(hook.params)
    if has_var and len(positional) <= len(expected):
        return True
    if [p.name for p in positional[: len(expected)]] != expected:
        return False
    # Anything after the contract's parameters must have a default.
    return len(required_names) <= len(expected) and not any(
        p.kind is p.KEYWORD_ONLY and p.default is p.empty for p in params
    )


def check_contract(kind: PluginKind, entry: PluginEntry, cls: Any) -> None:
    """Reject a plugin whose shape does not match its kind's contract, naming what is expected."""
    if not inspect.isclass(cls):
        raise PluginError(f"{kind.value} plugin {entry.describe()} is not a class; register a class")
    config = getattr(cls, "Config", None)
    if not (inspect.isclass(config) and issubclass(config, BaseModel)):
        raise PluginError(
            f"{kind.value} plugin {entry.describe()} has no nested pydantic `Config` model; "
            "add `class Config(pydantic.BaseModel)` (it may be empty)"
        )
    for hook in HOOKS[kind]:
        if not _hook_matches(cls, hook):
            raise PluginError(
                f"{kind.value} plugin {entry.describe()} does not match the contract: expected "
                f"`{hook.signature()}`"
            )
    for hook in OPTIONAL_HOOKS.get(kind, ()):
        if inspect.getattr_static(cls, hook.name, _ABSENT) is not _ABSENT and not _hook_matches(cls, hook):
            raise PluginError(
                f"{kind.value} plugin {entry.describe()} defines `{hook.name}` but not as the contract's "
                f"optional `{hook.signature()}`; fix its parameters or remove it"
            )
    for capability, protocol in CAPABILITIES.get(kind, {}).items():
        if not _claims(cls, kind, capability, protocol):
            continue
        for hook in protocol_hooks(protocol):
            if not _hook_matches(cls, hook):
                raise PluginError(
                    f"{kind.value} plugin {entry.describe()} has the {capability} capability "
                    f"(relax.contracts.{protocol.__name__}) but not as the contract says: expected "
                    f"`{hook.signature()}`; fix the method or remove the capability's methods"
                )
    for name, declared in TRAITS.get(kind, {}).items():
        value = inspect.getattr_static(cls, name, _ABSENT)
        if value is _ABSENT:
            continue
        if isinstance(value, (classmethod, staticmethod)):
            value = getattr(cls, name)
        if not declared.accepts(value):
            raise PluginError(
                f"{kind.value} plugin {entry.describe()} declares trait `{name} = {value!r}`, but "
                f"{name} must be {declared.expected} ({declared.meaning}); fix the class attribute "
                "or remove it to get the default"
            )


_ABSENT = object()


def _claims(cls: Any, kind: PluginKind, capability: str, protocol: type) -> bool:
    """Whether a plugin class claims a capability: it defines the protocol's first method, or for
    ``pausing`` declares the ``pausable`` trait."""
    if capability == "pausing":
        return trait(cls, kind, "pausable") is True
    first = protocol_hooks(protocol)[0].name
    return callable(getattr(cls, first, None))


def supports(cls: Any, kind: PluginKind | str, capability: str) -> bool:
    """Whether a plugin class (or instance) has a capability of ``relax.contracts.CAPABILITIES``:
    it claims it and has every method of its protocol with the protocol's parameters. ``cls`` None
    (a plugin that could not be loaded) has none. Read from the class: asking imports no engine."""
    kind = PluginKind(kind)
    protocols = CAPABILITIES.get(kind, {})
    if capability not in protocols:
        raise KeyError(f"{kind.value} plugins have no capability '{capability}' (they have: "
                       f"{', '.join(sorted(protocols)) or 'none'}); add it to relax.contracts.CAPABILITIES")
    if cls is None:
        return False
    owner = cls if inspect.isclass(cls) else type(cls)
    protocol = protocols[capability]
    return _claims(cls, kind, capability, protocol) and all(_hook_matches(owner, h) for h in protocol_hooks(protocol))


def trait(cls: Any, kind: PluginKind | str, name: str) -> Any:
    """The value of trait ``name`` (declared for ``kind`` in ``relax.contracts.TRAITS``) on a
    plugin class or instance, or the trait's default when it does not set one. A trait the kind
    does not declare is a programming error (KeyError naming the declared ones)."""
    kind = PluginKind(kind)
    declared = TRAITS.get(kind, {})
    if name not in declared:
        raise KeyError(f"{kind.value} plugins declare no trait '{name}' (they declare: "
                       f"{', '.join(sorted(declared)) or 'none'}); add it to relax.contracts.TRAITS")
    if cls is None:
        return declared[name].default
    return getattr(cls, name, declared[name].default)


_default: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry (each Ray worker process has its own, built the same way)."""
    global _default
    if _default is None:
        _default = Registry()
    return _default
