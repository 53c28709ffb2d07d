"""Plugin discovery and contract checks, with fake distributions written into tmp_path.

``importlib.metadata.entry_points`` scans ``sys.path`` for ``*.dist-info`` folders, so a folder
holding ``fakepkg-0.1.dist-info/{METADATA,entry_points.txt}`` and the plugin modules, put first on
``sys.path``, is an installed distribution as far as a fresh ``Registry`` is concerned. Every test
uses its own module names, so modules cached in ``sys.modules`` never leak between tests.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from relax.contracts import PluginKind
from relax.registry import PluginError, PluginNotFound, Registry

GOOD_REWARD = """
from pydantic import BaseModel, ConfigDict, Field

class Reward:
    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        scale: float = Field(1.0, gt=0)

    def __init__(self, config):
        self.config = config

    def score(self, samples, *, verbose=False):
        return [self.config.scale for _ in samples]
"""


def install_fake(root: Path, monkeypatch, entry_points: dict[str, dict[str, str]],
                 modules: dict[str, str], dist: str = "fakepkg") -> Registry:
    """Write a distribution with these entry points ({group: {name: target}}) and modules."""
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    sections = [f"[{group}]\n" + "".join(f"{n} = {t}\n" for n, t in eps.items())
                for group, eps in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(sections))
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    return Registry()


def test_plugin_that_fails_to_import_is_reported_and_others_still_load(tmp_path, monkeypatch):
    registry = install_fake(tmp_path, monkeypatch, {"relax.rewards": {
        "broken": "fake_rg_broken:Reward", "good": "fake_rg_good:Reward"}}, {
        "fake_rg_broken": "import fake_missing_dependency_xyz\n",
        "fake_rg_good": GOOD_REWARD})
    with pytest.raises(PluginError) as caught:
        registry.load(PluginKind.rewards, "broken")
    message = str(caught.value)
    assert "failed to import" in message
    assert "fakepkg" in message  # the distribution
    assert "'broken'" in message and "fake_rg_broken:Reward" in message  # the entry point
    assert "fake_missing_dependency_xyz" in message  # the cause
    assert registry.load(PluginKind.rewards, "good").__name__ == "Reward"
    assert set(registry.entries(PluginKind.rewards)) >= {"broken", "good"}


def test_failed_import_is_remembered_not_retried(tmp_path, monkeypatch):
    log = tmp_path / "imports.log"
    registry = install_fake(tmp_path, monkeypatch, {"relax.rewards": {"broken": "fake_rg_once:Reward"}}, {
        "fake_rg_once": f"open({str(log)!r}, 'a').write('imported\\n')\nraise RuntimeError('boom')\n"})
    for _ in range(3):
        with pytest.raises(PluginError, match="RuntimeError: boom"):
            registry.load(PluginKind.rewards, "broken")
    assert log.read_text() == "imported\n"


def test_discovery_does_not_import_plugin_modules(tmp_path, monkeypatch):
    registry = install_fake(tmp_path, monkeypatch, {"relax.rewards": {"lazy": "fake_rg_lazy:Reward"}},
                            {"fake_rg_lazy": GOOD_REWARD})
    entry = registry.entries(PluginKind.rewards)["lazy"]
    assert (entry.distribution, entry.version, entry.target) == ("fakepkg", "0.1", "fake_rg_lazy:Reward")
    assert "fake_rg_lazy" not in sys.modules
    registry.load(PluginKind.rewards, "lazy")
    assert "fake_rg_lazy" in sys.modules


def test_plugin_without_config_is_rejected(tmp_path, monkeypatch):
    registry = install_fake(tmp_path, monkeypatch, {"relax.rewards": {"noconf": "fake_rg_noconf:Reward"}}, {
        "fake_rg_noconf": """
            class Reward:
                def __init__(self, config):
                    pass

                def score(self, samples):
                    return []
            """})
    with pytest.raises(PluginError) as caught:
        registry.load(PluginKind.rewards, "noconf")
    assert "'noconf'" in str(caught.value) and "fakepkg" in str(caught.value)
    assert "Config" in str(caught.value)


def test_plugin_whose_config_is_not_pydantic_is_rejected(tmp_path, monkeypatch):
    registry = install_fake(tmp_path, monkeypatch, {"relax.rewards": {"dictconf": "fake_rg_dictconf:Reward"}}, {
        "fake_rg_dictconf": """
            class Reward:
                Config = dict

                def __init__(self, config):
                    pass

                def score(self, samples):
                    return []
            """})
    with pytest.raises(PluginError, match="pydantic `Config`"):
        registry.load(PluginKind.rewards, "dictconf")


def test_hook_with_wrong_signature_is_rejected_naming_the_expected_one(tmp_path, monkeypatch):
    registry = install_fake(tmp_path, monkeypatch, {"relax.rewards": {"badsig": "fake_rg_badsig:Reward"}}, {
        "fake_rg_badsig": """
            from pydantic import BaseModel

            class Reward:
                class Config(BaseModel):
                    pass

                def __init__(self, config):
                    pass

                def score(self, batch, tokenizer):
                    return []
            """})
    with pytest.raises(PluginError) as caught:
        registry.load(PluginKind.rewards, "badsig")
    assert "'badsig'" in str(caught.value)
    assert "expected `score(self, samples)`" in str(caught.value)


def test_missing_init_parameter_is_rejected_naming_the_expected_one(tmp_path, monkeypatch):
    registry = install_fake(tmp_path, monkeypatch, {"relax.rewards": {"noinit": "fake_rg_noinit:Reward"}}, {
        "fake_rg_noinit": """
            from pydantic import BaseModel

            class Reward:
                class Config(BaseModel):
                    pass

                def score(self, samples):
                    return []
            """})
    with pytest.raises(PluginError, match=r"expected `__init__\(self, config\)`"):
        registry.load(PluginKind.rewards, "noinit")


def test_trainer_missing_a_hook_is_rejected(tmp_path, monkeypatch):
    registry = install_fake(tmp_path, monkeypatch, {"relax.trainer": {"half": "fake_rg_half:Trainer"}}, {
        "fake_rg_half": """
            from pydantic import BaseModel

            class Trainer:
                class Config(BaseModel):
                    pass

                def __init__(self, config, context):
                    pass

                def compute_logprobs(self, batch):
                    pass

                def train_step(self, batch):
                    pass
            """})
    with pytest.raises(PluginError, match=r"expected `weights\(self\)`"):
        registry.load(PluginKind.trainer, "half")


def test_entry_point_that_is_not_a_class_is_rejected(tmp_path, monkeypatch):
    registry = install_fake(tmp_path, monkeypatch, {"relax.rewards": {"func": "fake_rg_func:score"}},
                            {"fake_rg_func": "def score(samples):\n    return []\n"})
    with pytest.raises(PluginError, match="is not a class"):
        registry.load(PluginKind.rewards, "func")


def test_plugin_not_installed_lists_installed_ones(tmp_path, monkeypatch):
    registry = install_fake(tmp_path, monkeypatch, {"relax.rewards": {"good": "fake_rg_listed:Reward"}},
                            {"fake_rg_listed": GOOD_REWARD})
    with pytest.raises(PluginNotFound) as caught:
        registry.load(PluginKind.rewards, "absent")
    assert "installed:" in str(caught.value) and "good" in str(caught.value)
    assert "relax.rewards" in str(caught.value)


def test_options_are_checked_against_the_plugin_config(tmp_path, monkeypatch):
    registry = install_fake(tmp_path, monkeypatch, {"relax.rewards": {"good": "fake_rg_opts:Reward"}},
                            {"fake_rg_opts": GOOD_REWARD})
    assert registry.validate_options(PluginKind.rewards, "good", {"scale": 2.0}, "rewards[0].options") == []
    issues = registry.validate_options(PluginKind.rewards, "good", {"scale": 0, "scael": 1},
                                       "rewards[2].options")
    assert sorted(i.path for i in issues) == ["rewards[2].options.scael", "rewards[2].options.scale"]
    assert all("'good'" in i.message and "fakepkg" in i.message for i in issues)
    assert registry.build_config(PluginKind.rewards, "good", {"scale": 3}).scale == 3.0


def test_relax_registry_imports_on_its_own():
    # A fresh interpreter whose first Relax import is the registry (as a plugin's test might do).
    result = subprocess.run([sys.executable, "-c", "import relax.registry"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
