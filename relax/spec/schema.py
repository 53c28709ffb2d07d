"""The JSON Schema of the run spec and the Markdown spec reference, both generated from the models.

``schemas/run-spec.schema.json`` and ``docs/spec-reference.md`` are checked in for editors and
readers; tests regenerate them and fail when they are stale (``relax schema --write`` updates both).
"""

from __future__ import annotations

import json
from typing import Any

from relax.spec.models import RunSpec

SCHEMA_ID = "https://relax.dev/schemas/run-spec.schema.json"


def run_spec_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a run spec, with the shipped plugins' options
    (``relax.spec.plugin_schema``)."""
    from relax.spec.plugin_schema import add_plugin_options

    schema = add_plugin_options(RunSpec.model_json_schema())
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID, **schema}


def schema_text() -> str:
    return json.dumps(run_spec_schema(), indent=2, sort_keys=True) + "\n"


def _type_of(prop: dict[str, Any], defs: dict[str, Any]) -> str:
    if "$ref" in prop:
        return prop["$ref"].split("/")[-1]
    if "enum" in prop:
        return " | ".join(json.dumps(v) for v in prop["enum"])
    if "const" in prop:
        return json.dumps(prop["const"])
    if "anyOf" in prop:
        return " or ".join(_type_of(p, defs) for p in prop["anyOf"])
    kind = prop.get("type", "any")
    if kind == "array":
        items = prop.get("items") or prop.get("prefixItems") or {}
        inner = _type_of(items, defs) if isinstance(items, dict) else ", ".join(_type_of(i, defs) for i in items)
        return f"list of {inner}"
    if kind == "object" and "additionalProperties" in prop and isinstance(prop["additionalProperties"], dict):
        return f"mapping to {_type_of(prop['additionalProperties'], defs)}"
    return str(kind)


def _constraints(prop: dict[str, Any]) -> str:
    marks = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<",
             "minItems": "items >=", "pattern": "matches"}
    return ", ".join(f"{sym} {prop[key]}" for key, sym in marks.items() if key in prop)


def _section(title: str, model: dict[str, Any], defs: dict[str, Any], seen: set[str], out: list[str]) -> None:
    out += [f"## `{title}`", "", model.get("description", "").strip(), "",
            "| key | type | default | constraints | meaning |", "| --- | --- | --- | --- | --- |"]
    nested: list[tuple[str, str]] = []
    required = set(model.get("required", ()))
    for key, prop in model.get("properties", {}).items():
        desc = " ".join(prop.get("description", "").split())
        out.append(f"| `{key}` | {_type_of(prop, defs)} | {_default_cell(key, prop, required)} | "
                   f"{_constraints(prop)} | {desc} |")
        for ref in _refs(prop):
            nested.append((f"{title}.{key}", ref))
    out.append("")
    for path, ref in nested:
        if ref not in seen:
            seen.add(ref)
            _section(f"{path}", defs[ref], defs, seen, out)


def _default_cell(key: str, prop: dict[str, Any], required: set[str]) -> str:
    """The default column: the value, **required** for a key the spec must give, and for a key
    whose default is built when the spec leaves it out (a section, a list) the word optional: the
    JSON Schema carries no value for those, but they are no less optional."""
    if "default" in prop:
        return f"`{json.dumps(prop['default'])}`"
    if key in required:
        return "**required**"
    return "optional (its defaults below)" if "$ref" in prop else "optional"


def _refs(prop: dict[str, Any]) -> list[str]:
    found = []
    if "$ref" in prop:
        found.append(prop["$ref"].split("/")[-1])
    for key in ("anyOf", "allOf"):
        for sub in prop.get(key, []):
            found += _refs(sub)
    if isinstance(prop.get("items"), dict):
        found += _refs(prop["items"])
    return found


def spec_reference_markdown() -> str:
    """The spec reference: every section and key with type, default, constraints and meaning."""
    schema = run_spec_schema()
    defs = schema.get("$defs", {})
    out = ["# Run spec reference", "",
           "Generated from the spec models by `relax schema --write`; do not edit by hand.", ""]
    _section("spec", schema, defs, set(), out)
    return "\n".join(out).rstrip() + "\n"
