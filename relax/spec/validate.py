"""Validate a loaded spec in one round: its shape (pydantic) and every cross-section rule whose
sections are well-shaped, so that one call reports every problem it can know.

``runnable=True`` adds what ``relax run`` checks before it starts anything: the rules of today's
runtime (``RUNTIME_RULES``) and this machine's GPUs (``relax.spec.machine``). ``relax validate``
and ``relax run`` ask for it; ``relax plan`` does not (it shows a GPU spec's layout anywhere).

Nothing here builds a model or starts a process: plugins are imported (their modules are light by
contract) but never instantiated, except a built-in model plugin asked for its architecture numbers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from relax.contracts import PluginKind
from relax.registry import PluginError, Registry, get_registry
from relax.spec.architecture import (
    BUILTIN_PREFIX,
    ArchitectureError,
    ModelArchitecture,
    architecture_from_hf_config,
    load_card,
)
from relax.spec.errors import SpecError, SpecIssue
from relax.spec.models import RunSpec
from relax.spec.rules import RULES, RUNTIME_RULES, Rule, RuleContext
from relax.spec.translate import issues_from_validation_error

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


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
        try:
            return architecture_from_hf_config(json.loads(config.read_text()), model_path), []
        except (ArchitectureError, json.JSONDecodeError) as exc:
            return None, [SpecIssue("model.path", str(exc), "")]
    if _HUB_ID.match(model_path):
        return load_card(model_path), []
    return None, [SpecIssue("model.path", f"{model_path} is neither a folder, a hub id nor builtin:<name>",
                            "give an existing model folder, an id like Qwen/Qwen3-4B, or builtin:tiny-lm")]


#: Files of which a Hugging Face model folder needs one for its tokenizer to load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tekken.json")


def model_folder_issues(model_path: str, base_dir: Path) -> list[SpecIssue]:
    """What ``relax run`` would otherwise find only after start-up: a model folder without tokenizer
    files, and a path that looks like a hub id (``models/my-model``) but is no folder here and no
    shipped card names (a mistyped folder: nothing is downloaded for it)."""
    if model_path.startswith(BUILTIN_PREFIX):
        return []
    try:
        folder = Path(model_path).expanduser()
    except RuntimeError:
        return []  # reported by resolve_architecture
    folder = folder if folder.is_absolute() else base_dir / folder
    if folder.is_dir():
        if (folder / "config.json").is_file() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
            return [SpecIssue("model.path", f"model folder {folder} has no tokenizer files (none of "
                                            f"{', '.join(TOKENIZER_FILES)})",
                              "save the tokenizer beside the weights: tokenizer.save_pretrained(folder)")]
        return []
    if _HUB_ID.match(model_path) and load_card(model_path) is None:
        return [SpecIssue("model.path", f"no such folder: {folder}; Relax never downloads a model, and no "
                                        f"shipped model card names '{model_path}'",
                          "fix the folder's name (relative paths are taken from the spec's folder), or "
                          f"download the model first (hf download {model_path} --local-dir <folder>) and give "
                          "that folder")]
    return []


def validate_spec(
    raw: dict[str, Any], *, base_dir: Path | None = None, registry: Registry | None = None,
    runnable: bool = False,
) -> RunSpec:
    """The typed spec, or a ``SpecError`` holding every problem found.

    Shape errors (unknown keys, wrong types, out-of-range values) are reported together with the
    findings of every rule that reads only well-shaped sections; a rule reading a broken section is
    skipped (its findings would be about defaults, not the user's spec). ``runnable`` adds the
    checks of what today's runtime can run on this machine (see the module docstring).
    """
    registry = registry or get_registry()
    base_dir = base_dir or Path.cwd()
    try:
        spec = RunSpec.model_validate(raw)
    except ValidationError as exc:
        issues = issues_from_validation_error(exc, RunSpec)
        broken = frozenset(str(err["loc"][0]) for err in exc.errors() if err["loc"])
        partial = _partial_spec(raw, broken)
        if partial is not None:
            issues += rule_issues(partial, base_dir=base_dir, registry=registry, broken=broken, runnable=runnable)
        raise SpecError(issues) from None
    return check_spec(spec, base_dir=base_dir, registry=registry, runnable=runnable)


def _partial_spec(raw: dict[str, Any], broken: frozenset[str]) -> RunSpec | None:
    """The spec with its broken sections left to their defaults (rules reading them are skipped),
    or None when even that does not validate (the spec is not a mapping, say)."""
    if not isinstance(raw, dict):
        return None
    sound = {key: value for key, value in raw.items() if key in RunSpec.model_fields and key not in broken}
    sound.setdefault("name", "partial")
    try:
        return RunSpec.model_validate(sound)
    except ValidationError:
        return None


def _section_of(path: str) -> str:
    """The top-level section of a dotted path (``rewards[0].name`` -> ``rewards``)."""
    return path.split(".")[0].split("[")[0]


def rules_to_run(runnable: bool) -> tuple[Rule, ...]:
    """The rules a validation runs, in order: what the spec means, then (``runnable``) what the
    runtime can run and whether this machine holds it."""
    if not runnable:
        return RULES
    from relax.spec.machine import check_machine

    return (*RULES, *RUNTIME_RULES, check_machine)


def rule_issues(spec: RunSpec, *, base_dir: Path, registry: Registry, broken: frozenset[str] = frozenset(),
                runnable: bool = False) -> list[SpecIssue]:
    """Every finding of the rules on ``spec``, leaving out what depends on a ``broken`` section."""
    issues: list[SpecIssue] = []
    architecture = None
    if "model" not in broken:
        architecture, issues = resolve_architecture(spec.model.path, base_dir, registry, spec.model.options)
        if runnable and not issues:
            issues = model_folder_issues(spec.model.path, base_dir)
    ctx = RuleContext(registry=registry, base_dir=base_dir, architecture=architecture)
    for check in rules_to_run(runnable):
        if check.per_section:
            issues.extend(i for i in check(spec, ctx) if _section_of(i.path) not in broken)
        elif not check.reads & broken:
            issues.extend(check(spec, ctx))
    return issues


def check_spec(spec: RunSpec, *, base_dir: Path | None = None, registry: Registry | None = None,
               runnable: bool = False) -> RunSpec:
    """Run every rule on a well-shaped spec; raise ``SpecError`` with all findings."""
    issues = rule_issues(spec, base_dir=base_dir or Path.cwd(), registry=registry or get_registry(),
                         runnable=runnable)
    if issues:
        raise SpecError(issues)
    return spec
