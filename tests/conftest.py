"""Shared fixtures: the test plugin distribution in ``tests/spec/testkit`` (see its module)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

TESTKIT = Path(__file__).parent / "spec" / "testkit"


@pytest.fixture(scope="module")
def testkit_registry():
    """A fresh registry that also sees the ``relax-testkit`` plugins (put first on sys.path)."""
    from relax.registry import Registry

    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(TESTKIT))
        importlib.invalidate_caches()
        yield Registry()
