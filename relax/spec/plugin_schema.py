"""Each built-in plugin's ``Config`` in the run spec's JSON Schema, so that an editor completes and
checks ``options:`` for the plugin a block names.

In the spec, options are free-form mappings (the plugin checks them at validation). In the JSON
Schema, each section that names a plugin gets one ``if``/``then`` per plugin: *if* the naming key
is that constant (``source: synthetic:arithmetic``, ``name: exact_match``, ``backend: hf``,
``path: builtin:tiny-lm``; a data file by its suffix) *then* its options follow that plugin's
``Config`` schema. Only the plugins this project ships (distribution ``relax-rl``) are written, so
the checked-in schema does not depend on what else is installed; a third-party plugin's options
stay free-form for editors and are checked by ``relax validate`` as before.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel

from relax.contracts import PluginKind
from relax.registry import PluginError, Registry, get_registry
from relax.spec.attribute_docs import document
from relax.spec.data_files import DATA_FILE_SUFFIXES, FOLDER_PLUGIN

#: The distribution whose plugins the checked-in schema describes.
SHIPPED = "relax-rl"

#: Spec model -> the plugin kind it names, the key naming the plugin, the options key, and how a
#: plugin name appears under the naming key.
NAMING: tuple[tuple[str, PluginKind, str, str, str], ...] = (
    ("DataSource", PluginKind.datasets, "source", "options", "{name}"),
    ("RewardSpec", PluginKind.rewards, "name", "options", "{name}"),
    ("ModelSpec", PluginKind.models, "path", "options", "builtin:{name}"),
    ("RolloutRole", PluginKind.rollout, "backend", "options", "{name}"),
    ("ForwardRole", PluginKind.trainer, "backend", "options", "{name}"),
    ("TrainRole", PluginKind.trainer, "backend", "options", "{name}"),
    ("AlgorithmSpec", PluginKind.advantages, "advantage", "advantage_options", "{name}"),
    ("AlgorithmSpec", PluginKind.losses, "loss", "loss_options", "{name}"),
    ("AgentSpec", PluginKind.environments, "environment", "environment_options", "{name}"),
)

#: Options the runtime fills in itself for a data file (the path from ``source``, the prompt
#: column from ``data.prompt_key``): not required of the user.
IMPLIED = {"path", "prompt_key"}


def _def_name(kind: PluginKind, name: str) -> str:
    return "plugin__" + re.sub(r"[^A-Za-z0-9_]", "_", f"{kind.value}__{name}")


def _config_schema(cls: type, def_name: str, defs: dict[str, Any], file_data: bool) -> bool:
    """Put the plugin's Config schema (and its own definitions, prefixed) into ``defs``."""
    config = getattr(cls, "Config", None)
    if not (isinstance(config, type) and issubclass(config, BaseModel)):
        return False
    schema = document(config).model_json_schema(ref_template=f"#/$defs/{def_name}__{{model}}")
    for sub, body in schema.pop("$defs", {}).items():
        defs[f"{def_name}__{sub}"] = body
    if file_data and "required" in schema:
        schema["required"] = [key for key in schema["required"] if key not in IMPLIED]
        if not schema["required"]:
            del schema["required"]
    defs[def_name] = schema
    return True


def add_plugin_options(schema: dict[str, Any], registry: Registry | None = None) -> dict[str, Any]:
    """``schema`` (the run spec's) with an ``if``/``then`` per shipped plugin in each section that
    names one (see the module doc); returns the same dict."""
    registry = registry or get_registry()
    defs = schema.setdefault("$defs", {})
    suffixes: dict[str, list[str]] = {}
    for suffix, plugin in DATA_FILE_SUFFIXES.items():
        suffixes.setdefault(plugin, []).append(suffix)
    for model, kind, name_key, options_key, shown in NAMING:
        if model not in defs:
            continue
        conditions = []
        test: dict[str, Any]
        for name, entry in sorted(registry.entries(kind).items()):
            if entry.distribution != SHIPPED:
                continue
            try:
                cls = registry.load(kind, name)
            except PluginError:
                continue
            file_data = kind is PluginKind.datasets and (name in suffixes or name == FOLDER_PLUGIN)
            def_name = _def_name(kind, name)
            if not _config_schema(cls, def_name, defs, file_data):
                continue
            if file_data and name == FOLDER_PLUGIN:  # a path without a data file suffix
                known = "|".join(re.escape(s) for s in DATA_FILE_SUFFIXES)
                test = {"type": "string", "pattern": "^[~.]|/", "not": {"pattern": f"({known})$"}}
            elif file_data:
                pattern = "|".join(re.escape(s) for s in suffixes[name])
                test = {"type": "string", "pattern": f"({pattern})$"}
            else:
                test = {"const": shown.format(name=name)}
            conditions.append({"if": {"properties": {name_key: test}, "required": [name_key]},
                               "then": {"properties": {options_key: {"$ref": f"#/$defs/{def_name}"}}}})
        if conditions:
            defs[model].setdefault("allOf", []).extend(conditions)
    return schema
