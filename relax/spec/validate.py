"""Validate a loaded spec: shape first (pydantic), then every cross-section rule.

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
from relax.spec.rules import RULES, RuleContext, check_plugins
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


def validate_spec(
    raw: dict[str, Any], *, base_dir: Path | None = None, registry: Registry | None = None
) -> RunSpec:
    """The typed spec, or a ``SpecError`` holding every problem found.

    Shape errors (unknown keys, wrong types, out-of-range values) are reported together; when the
    shape is right, every rule in ``relax.spec.rules.RULES`` runs and all their findings are
    reported together.
    """
    try:
        spec = RunSpec.model_validate(raw)
    except ValidationError as exc:
        issues = issues_from_validation_error(exc, RunSpec)
        issues += _plugin_issues_of_sound_sections(raw, exc, base_dir or Path.cwd(), registry or get_registry())
        raise SpecError(issues) from None
    return check_spec(spec, base_dir=base_dir, registry=registry)


def _plugin_issues_of_sound_sections(raw: dict[str, Any], exc: ValidationError, base_dir: Path,
                                     registry: Registry) -> list[SpecIssue]:
    """Plugin problems in the sections whose shape is right, so that a typo in one section does not
    hide a wrong plugin option in another. Cross-section rules wait for a well-shaped spec: with a
    broken section replaced by its defaults they could report problems that are not there."""
    broken = {str(err["loc"][0]) for err in exc.errors() if err["loc"]}
    sound = {key: value for key, value in raw.items() if key in RunSpec.model_fields and key not in broken}
    sound.setdefault("name", "partial")
    try:
        partial = RunSpec.model_validate(sound)
    except ValidationError:
        return []
    ctx = RuleContext(registry=registry, base_dir=base_dir)
    return [issue for issue in check_plugins(partial, ctx) if _section_of(issue.path) in sound]


def _section_of(path: str) -> str:
    """The top-level section of a dotted path (``rewards[0].name`` -> ``rewards``)."""
    return path.split(".")[0].split("[")[0]


def check_spec(spec: RunSpec, *, base_dir: Path | None = None, registry: Registry | None = None) -> RunSpec:
    """Run every cross-section rule on a well-shaped spec; raise ``SpecError`` with all findings."""
    registry = registry or get_registry()
    base_dir = base_dir or Path.cwd()
    architecture, issues = resolve_architecture(spec.model.path, base_dir, registry, spec.model.options)
    ctx = RuleContext(registry=registry, base_dir=base_dir, architecture=architecture)
    for rule in RULES:
        issues.extend(rule(spec, ctx))
    if issues:
        raise SpecError(issues)
    return spec
