"""Shared fixtures: the test plugin distribution in ``tests/spec/testkit`` (see its module), and the
built-in loggers' entry points for an editable install made before they were declared."""

from __future__ import annotations

import importlib
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

TESTKIT = Path(__file__).parent / "spec" / "testkit"
ROOT = Path(__file__).resolve().parents[1]


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
