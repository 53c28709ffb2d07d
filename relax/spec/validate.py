"""Validate a loaded spec in one round: its shape (pydantic) and every cross-section rule, each
as far as the fields it reads are well-shaped, so that one call reports every problem it can know.

``runnable=True`` adds what ``relax run`` checks before it starts anything: the rules of today's
runtime (``RUNTIME_RULES``) and, with ``here``, this machine's GPUs (``relax.spec.machine``).
``relax run`` and ``relax validate --here`` ask for both; ``relax validate`` judges the spec, not
the machine it is written on, and prints what this machine lacks as notes (``machine_notes``);
``relax plan`` asks for neither (it shows a GPU spec's layout anywhere).

Nothing here builds a model or starts a process: plugins are imported (their modules are light by
contract) but never instantiated, except a built-in model plugin asked for its architecture numbers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from relax.contracts import PluginKind
from relax.errors import SpecError, SpecIssue
from relax.errors.translate import issues_from_validation_error
from relax.registry import PluginError, Registry, get_registry
from relax.spec.architecture import (
    BUILTIN_PREFIX,
    ArchitectureError,
    ModelArchitecture,
    architecture_from_hf_config,
    load_card,
)
from relax.spec.hf_cache import HUB_ID, TOKENIZER_FILES, cached_snapshot, download_hint, has_tokenizer, hub_cache_dir
from relax.spec.models import RunSpec
from relax.spec.rules import RULES, RUNTIME_RULES, Rule, RuleContext
from relax.spec.soundness import UnsoundRead, findings, sound_spec


def resolve_architecture(
    model_path: str, base_dir: Path, registry: Registry, options: dict[str, Any] | None = None
) -> tuple[ModelArchitecture | None, list[SpecIssue]]:
    """The model's numbers, or None when they cannot be known here (an unknown hub id)."""
    if model_path.startswith(BUILTIN_PREFIX):
        name = model_path[len(BUILTIN_PREFIX):]
        try:
            cls = registry.load(PluginKind.models, name)
        except PluginError as exc:
            return None, [SpecIssue("model.path", str(exc), "")]
        issues = registry.validate_options(PluginKind.models, name, options or {}, "model.options")
        if issues:
            return None, issues
        try:
            numbers = cls(cls.Config.model_validate(options or {})).architecture()
        except ValueError as exc:
            return None, [SpecIssue("model.options", str(exc), "")]
        return ModelArchitecture.model_validate(numbers), []
    if options:
        return None, [SpecIssue("model.options", "options are only for built-in models (builtin:<name>)",
                                "remove model.options, or use a builtin: model")]
    try:
        folder = Path(model_path).expanduser()
    except RuntimeError:  # "~user/..." for a user that does not exist
        return None, [SpecIssue("model.path", f"cannot expand '~' in {model_path}: no such user",
                                "give an absolute path, or a path relative to the spec's folder")]
    folder = folder if folder.is_absolute() else base_dir / folder
    if folder.is_dir():
        config = folder / "config.json"
        if not config.is_file():
            return None, [SpecIssue("model.path", f"folder {folder} has no config.json",
                                    "point it at a Hugging Face model folder (save_pretrained output)")]
        return _architecture_of(config, model_path)
    if HUB_ID.match(model_path):
        snapshot = cached_snapshot(model_path)
        if snapshot is not None:  # the model's own numbers win over a shipped card
            return _architecture_of(snapshot / "config.json", model_path)
        return load_card(model_path), []
    return None, [SpecIssue("model.path", f"no such folder: {folder} ({model_path} is no hub id and no "
                                          "builtin:<name> either)",
                            "give an existing model folder (relative paths are taken from the spec's folder), an "
                            "id like Qwen/Qwen3-4B, or builtin:tiny-lm; a cluster's own paths exist only there: "
                            "validate such a spec on a node of the cluster (docs/cluster.md)")]


def _architecture_of(config: Path, model_path: str) -> tuple[ModelArchitecture | None, list[SpecIssue]]:
    """The numbers of a ``config.json`` (a model folder's or a cached snapshot's), or the issue
    naming the file when it cannot be read."""
    try:
        return architecture_from_hf_config(json.loads(config.read_text()), model_path), []
    except (ArchitectureError, json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
        return None, [SpecIssue("model.path", f"{config}: {exc}", "")]


def model_folder_issues(model_path: str, base_dir: Path) -> list[SpecIssue]:
    """What ``relax run`` would otherwise find only after start-up: a model folder without tokenizer
    files; a hub id neither in this machine's Hugging Face cache nor named by a shipped card (a
    mistyped folder, or a model never downloaded: Relax downloads nothing). Whether this machine's
    cache holds the whole model a run here loads is a machine check
    (``relax.spec.machine.check_model_on_this_machine``)."""
    if model_path.startswith(BUILTIN_PREFIX):
        return []
    try:
        folder = Path(model_path).expanduser()
    except RuntimeError:
        return []  # reported by resolve_architecture
    folder = folder if folder.is_absolute() else base_dir / folder
    if folder.is_dir():
        if (folder / "config.json").is_file() and not has_tokenizer(folder):
            return [SpecIssue("model.path", f"model folder {folder} has no tokenizer files (none of "
                                            f"{', '.join(TOKENIZER_FILES)})",
                              "save the tokenizer beside the weights: tokenizer.save_pretrained(folder)")]
        return []
    if not HUB_ID.match(model_path):
        return []  # reported by resolve_architecture
    if cached_snapshot(model_path) is None and load_card(model_path) is None:
        return [SpecIssue("model.path", f"no such folder: {folder}, and the Hugging Face cache at {hub_cache_dir()} "
                                        f"has no config.json for '{model_path}'; Relax never downloads a model, and "
                                        "no shipped model card names it",
                          "fix the folder's name (relative paths are taken from the spec's folder), or "
                          + download_hint(model_path))]
    return []


def validate_spec(
    raw: dict[str, Any], *, base_dir: Path | None = None, registry: Registry | None = None,
    runnable: bool = False, here: bool = True,
) -> RunSpec:
    """The typed spec, or a ``SpecError`` holding every problem found.

    Shape errors (unknown keys, wrong types, out-of-range values) are reported together with the
    findings of every rule, each run as long as the fields it reads are sound (``relax.spec.soundness``:
    a rule stops at the first broken field it uses, whose default is not the user's). ``runnable``
    adds the checks of what today's runtime can run, and with ``here`` (as for ``relax run`` and
    ``relax validate --here``) whether this machine holds it; see the module docstring.
    """
    registry = registry or get_registry()
    base_dir = base_dir or Path.cwd()
    try:
        spec = RunSpec.model_validate(raw)
    except ValidationError as exc:
        issues = issues_from_validation_error(exc, RunSpec)
        partial, unsound = sound_spec(raw)
        if partial is not None:
            issues += rule_issues(partial, base_dir=base_dir, registry=registry, unsound=unsound,
                                  runnable=runnable, here=here)
        raise SpecError(issues) from None
    return check_spec(spec, base_dir=base_dir, registry=registry, runnable=runnable, here=here)


def rules_to_run(runnable: bool, here: bool = True) -> tuple[Rule, ...]:
    """The rules a validation runs, in order: what the spec means, then (``runnable``) what the
    runtime can run and (``here``) whether this machine holds it."""
    if not runnable:
        return RULES
    if not here:
        return (*RULES, *RUNTIME_RULES)
    from relax.spec.machine import MACHINE_RULES

    return (*RULES, *RUNTIME_RULES, *MACHINE_RULES)


def _within(path: str, unsound: list[str]) -> bool:
    """Whether ``path`` is a broken field or lies inside one (its shape error says it already)."""
    return any(path == u or path.startswith((u + ".", u + "[")) for u in unsound)


def rule_issues(spec: RunSpec, *, base_dir: Path, registry: Registry, unsound: list[str] | None = None,
                runnable: bool = False, here: bool = True) -> list[SpecIssue]:
    """Every finding of the rules on ``spec``; on a spec with broken fields (``unsound``, marked
    by ``sound_spec``), each rule's findings until it uses one, less any about a broken field."""
    unsound = unsound or []
    issues: list[SpecIssue] = []
    architecture = None
    try:
        architecture, issues = resolve_architecture(spec.model.path, base_dir, registry, spec.model.options)
        if runnable and not issues:
            issues = model_folder_issues(spec.model.path, base_dir)
    except UnsoundRead:
        architecture, issues = None, []  # a broken model section: its shape error says so
    ctx = RuleContext(registry=registry, base_dir=base_dir, architecture=architecture)
    for check in rules_to_run(runnable, here):
        issues.extend(i for i in findings(check, spec, ctx) if not _within(i.path, unsound))
    return issues


def machine_notes(spec: RunSpec, *, base_dir: Path | None = None, registry: Registry | None = None) -> list[SpecIssue]:
    """What keeps a valid spec from running on this machine (its GPUs): notes for ``relax validate``,
    which judges a spec wherever it is written (a laptop authoring for a cluster); errors for
    ``relax run`` and ``relax validate --here``."""
    from relax.spec.machine import MACHINE_RULES

    ctx = RuleContext(registry=registry or get_registry(), base_dir=base_dir or Path.cwd())
    return [issue for check in MACHINE_RULES for issue in findings(check, spec, ctx)]


def check_spec(spec: RunSpec, *, base_dir: Path | None = None, registry: Registry | None = None,
               runnable: bool = False, here: bool = True) -> RunSpec:
    """Run every rule on a well-shaped spec; raise ``SpecError`` with all findings."""
    issues = rule_issues(spec, base_dir=base_dir or Path.cwd(), registry=registry or get_registry(),
                         runnable=runnable, here=here)
    if issues:
        raise SpecError(issues)
    return spec
