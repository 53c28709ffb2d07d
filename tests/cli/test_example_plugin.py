"""The example third-party plugin, installed with pip like any package, seen by the CLI.

``examples/relax-reward-length`` is installed with ``pip install --target`` into a temporary folder,
and the CLI runs with that folder on ``PYTHONPATH``: entry points are found exactly as for a
package installed into site-packages.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from .conftest import ROOT

EXAMPLE = ROOT / "examples" / "relax-reward-length"
SPEC = str(ROOT / "examples" / "length-reward.yaml")


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    """The folder the example package is installed into (built from a copy, so the tree stays clean)."""
    work = tmp_path_factory.mktemp("example-plugin")
    source = work / "src"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = work / "site"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--quiet", "--disable-pip-version-check", "--target", str(target), str(source)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return [target]


def test_plugins_lists_it_with_its_distribution_and_options(relax, plugin_path):
    result = relax("plugins", "--kind", "rewards", "--json", pythonpath=plugin_path)
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    row = rows["length_penalty"]
    assert (row["kind"], row["distribution"], row["version"], row["status"]) == (
        "rewards", "relax-reward-length", "0.1.0", "ok")
    assert row["target"] == "relax_reward_length.reward:LengthPenalty"
    assert set(row["options"]) == {"target_chars", "scale", "max_penalty", "strip"}
    assert row["options"]["target_chars"]["help"].startswith("Longest response")
    assert row["options"]["target_chars"]["type"] == "int"


def test_plugins_table_shows_it(relax, plugin_path):
    result = relax("plugins", "--kind", "rewards", pythonpath=plugin_path)
    assert result.returncode == 0, result.stderr
    assert "length_penalty" in result.stdout and "relax-reward-length 0.1.0" in result.stdout
    assert "target_chars (int, " in result.stdout


def test_spec_naming_it_validates(relax, plugin_path):
    result = relax("validate", SPEC, pythonpath=plugin_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok: tiny-length is valid")


def test_out_of_range_option_exits_2_with_its_path(relax, plugin_path):
    result = relax("validate", SPEC, "rewards.1.options.target_chars=0", pythonpath=plugin_path)
    assert result.returncode == 2
    assert "rewards[1].options.target_chars:" in result.stderr
    assert "relax-reward-length" in result.stderr  # the message names the plugin's distribution
    assert "Traceback" not in result.stderr


def test_unknown_option_exits_2_with_a_suggestion(relax, plugin_path):
    result = relax("validate", SPEC, "rewards.1.options.target=3", pythonpath=plugin_path)
    assert result.returncode == 2
    assert "rewards[1].options.target:" in result.stderr
    assert "did you mean 'target_chars'?" in result.stderr


def test_without_the_package_the_spec_names_a_missing_plugin(relax):
    result = relax("validate", SPEC)
    assert result.returncode == 2
    assert "rewards[1].name:" in result.stderr
    assert "exact_match" in result.stderr  # the installed rewards are listed
