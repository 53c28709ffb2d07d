"""The one part of the build that pyproject.toml cannot say: ``presets/`` sits at the top of the
checkout (next to the code it configures, where a reader looks for it) and ships inside the package
as ``relax/presets/``, so ``relax run tiny-cpu`` works from a wheel as from a checkout.

``[tool.setuptools.packages.find]`` cannot be combined with a ``package-dir`` entry for one
subpackage, so the package list is found here: every ``relax*`` and ``relax_plugins*`` package of
the checkout, plus ``relax.presets`` (and its data folders) mapped from ``presets/``. The presets'
files are package data (``[tool.setuptools.package-data]`` in pyproject.toml).
"""

from setuptools import find_namespace_packages, setup

PRESETS = {"relax.presets": "presets"}
preset_packages = ["relax.presets", *(f"relax.presets.{p}" for p in find_namespace_packages("presets"))]
packages = [p for p in find_namespace_packages(include=["relax", "relax.*", "relax_plugins", "relax_plugins.*"])
            if not p.startswith("relax.presets")]

setup(packages=[*packages, *preset_packages], package_dir=PRESETS)
