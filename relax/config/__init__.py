"""Loading run specs: files, presets, ``extends:``, interpolation and command-line overrides."""

from relax.config.loader import list_presets, load_spec_dict
from relax.config.overrides import parse_override

__all__ = ["list_presets", "load_spec_dict", "parse_override"]
