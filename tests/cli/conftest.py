"""Run the ``relax`` command line in a fresh interpreter, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_relax(*args: str, pythonpath: list[Path] = (), cwd: Path = ROOT,
              env_vars: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m relax ARGS`` with extra ``PYTHONPATH`` entries (e.g. a plugin's install folder)
    and environment variables."""
    env = {**os.environ, **(env_vars or {})}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), env.get("PYTHONPATH", "")]).strip(os.pathsep)
    return subprocess.run([sys.executable, "-m", "relax", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=120)


@pytest.fixture
def relax():
    return run_relax
