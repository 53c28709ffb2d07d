"""The wheel: what a ``pip install relax-rl`` (not a checkout) gets. The presets and their sample
data sit in ``presets/`` at the top of the checkout and ship as package data under
``relax/presets/`` (``setup.py`` maps the folder); a wheel without them makes ``relax run tiny-cpu``
fail with an empty list of presets.

The wheel is built from a copy of the project in a temporary folder, so the checkout gets no
``build/`` and no rewritten ``*.egg-info``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ROOT / "presets"
#: What setuptools reads to build the wheel (pyproject.toml names README.md as the readme).
SOURCES = ("pyproject.toml", "setup.py", "README.md", "relax", "relax_plugins", "presets")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    [built] = out.glob("relax_rl-*.whl")
    return built


def test_the_wheel_ships_every_preset_and_its_sample_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "relax/presets/tiny-cpu.yaml" in names
    assert "relax/presets/data/math-sample.jsonl" in names
    assert "relax/presets/data/media/red.png" in names
    shipped = sorted("relax/" + p.relative_to(ROOT).as_posix() for p in PRESETS.rglob("*")
                     if p.is_file() and "__pycache__" not in p.parts)
    assert sum(name.endswith(".yaml") for name in shipped) >= 8
    assert [name for name in shipped if name not in names] == []
    assert not any(name.startswith("presets/") for name in names)  # only inside the package


def test_the_wheel_ships_every_package_of_the_checkout(wheel):
    """setup.py finds the packages (pyproject's find cannot map ``presets/``): each module of
    ``relax`` and ``relax_plugins`` is in the wheel, the runtime's rooms included."""
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = sorted(p.relative_to(ROOT).as_posix() for package in ("relax", "relax_plugins")
                     for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts
                     and not p.relative_to(ROOT).as_posix().startswith("relax/presets/"))
    assert "relax/runtime/driver/launch.py" in modules
    assert [name for name in modules if name not in names] == []


def test_a_preset_name_runs_from_the_installed_wheel(wheel, tmp_path):
    """``relax validate tiny-cpu`` from the wheel's files (first on ``PYTHONPATH``), outside the
    checkout: the preset is found next to the installed package."""
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check",
         "-q", "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    env = {**os.environ, "PYTHONPATH": str(target)}
    env.pop("RELAX_PRESETS_PATH", None)
    where = subprocess.run([sys.executable, "-c", "import relax; print(relax.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert Path(where.stdout.strip()).is_relative_to(target), where.stdout + where.stderr
    result = subprocess.run([sys.executable, "-m", "relax", "validate", "tiny-cpu"],
                            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok: ")
