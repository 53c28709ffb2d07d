"""Test lanes. The default lane is what `.ci/run` and the README run; heavier lanes (vLLM,
Megatron) get their own sessions. Sessions reuse the current interpreter's environment
(`venv_backend="none"`) because the pinned CPU torch must be installed in the same pip command as
its dependents, which the project's install already does."""

import nox

nox.options.sessions = ["tests"]


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """The default suite: unit, integration (real Ray, real bus) and end-to-end tests."""
    session.run("pip", "install", "-e", ".[test]")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """The benchmark scripts under bench/ (they print ratios measured side by side)."""
    session.run("python", "bench/validate_speed.py")
