"""A program module that imports in the test's own process and nowhere else (its worker processes
then cannot start): ``RELAX_TEST_DRIVER_PID`` names the process allowed to import it."""

from __future__ import annotations

import os

if os.environ.get("RELAX_TEST_DRIVER_PID") != str(os.getpid()):
    raise ImportError("this module imports only in the process RELAX_TEST_DRIVER_PID names")


def program(task, base_url: str, api_key: str) -> None:
    """Never runs in a worker."""
