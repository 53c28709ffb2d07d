"""Loading run specs: files, presets, ``extends:``, interpolation and command-line overrides."""

from typing import Any

from relax.config.loader import LoadedSpec, list_presets, load_spec, load_spec_dict

__all__ = ["LoadedSpec", "list_presets", "load_spec", "load_spec_dict", "parse_override"]


def __getattr__(name: str) -> Any:
    # Loaded on first use: the overrides import omegaconf, which a plain spec file does without
    # (relax.config.plain).
    if name == "parse_override":
        from relax.config.overrides import parse_override

        return parse_override
    raise AttributeError(f"module 'relax.config' has no attribute {name!r}")
