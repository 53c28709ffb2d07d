"""Shared fixtures: the test plugin distribution in ``tests/spec/testkit`` (see its module), and the
built-in loggers' entry points for an editable install made before they were declared."""

from __future__ import annotations

import importlib
import random
import sys
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

TESTKIT = Path(__file__).parent / "spec" / "testkit"
ROOT = Path(__file__).resolve().parents[1]
TEST_SEED = 1234


@pytest.fixture(autouse=True)
def _same_random_draws_every_run():
    """Every test starts from the same seed in ``random``, numpy and torch (when a test module has
    imported them), whatever ran before it: a test that draws random tensors without a generator
    draws the same ones on a fresh clone, in CI, alone or in the whole suite. Torch and numpy are
    not imported here, so tests of what stays light keep their processes light."""
    random.seed(TEST_SEED)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(TEST_SEED)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(TEST_SEED)
    yield


@pytest.fixture(autouse=True)
def _no_off_machine_attempt():
    """A test that connects to, sends to or looks up a host off this machine fails, naming it
    (``tests/network_guard.py``): the suite must pass without a network, and never phone home."""
    from tests import network_guard

    network_guard.install()
    before = len(network_guard.ATTEMPTS)
    yield
    made = network_guard.ATTEMPTS[before:]
    if made:
        pytest.fail("this test tried to reach another machine: " + "; ".join(dict.fromkeys(made)), pytrace=False)


@pytest.fixture(scope="module")
def testkit_registry():
    """A fresh registry that also sees the ``relax-testkit`` plugins (put first on sys.path)."""
    from relax.registry import Registry

    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(TESTKIT))
        importlib.invalidate_caches()
        yield Registry()


@pytest.fixture
def loggers_registered(tmp_path_factory, monkeypatch):
    """The built-in loggers as entry points. An editable install made before they existed has no
    ``relax.loggers`` group in its metadata; then a distribution holding this checkout's
    pyproject.toml entries for that group goes first on sys.path, and the registry starts afresh."""
    if not entry_points().select(group="relax.loggers"):
        declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["relax.loggers"]
        info = tmp_path_factory.mktemp("dist") / "relax_loggers_checkout-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: relax-loggers-checkout\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(
            "[relax.loggers]\n" + "".join(f"{n} = {t}\n" for n, t in declared.items()))
        monkeypatch.syspath_prepend(str(info.parent))
        importlib.invalidate_caches()
    import relax.registry

    monkeypatch.setattr(relax.registry, "_default", None)
    yield
    relax.registry._default = None
